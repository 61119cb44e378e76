"""The generator's view of a model: its prefill and decode steps with their fast paths chosen once.

`CausalLM`'s own forward is the training forward, one path: each projection its own product. `DecodingModel`, built
from a model by what generates with it (`generate`'s `DecodeGraphs`, vLLM's `WorkbenchCausalLM`), picks per layer,
from the weights' layout and the kernel modes in force when it is built:
- q/k/v as one product and gate/up as another, where `CausalLM.pack` laid their weights out in one buffer and no
  adapter or hook sits on them (`packing.py`); else each projection's own module (LoRA, a model moved by `.to()`).
  The product is the kernel library's `linear`, or, for projections of another kind (the fp8 sampler's
  `Fp8Linear`, its codes laid out so), that kind's own (`packed_product`);
- over a static `KVCache`, with invariant norm and rope: q/k's norm and rotation and the cache write in one kernel
  (`rope_cache_write`), then attention over the cache;
- with invariant linear and silu_mul: silu_mul in the gate/up product's epilogue (`swiglu_product`, at the sizes
  it covers: decode steps).
In invariant mode every path has the training forward's bits (the fused kernels' contracts, tests/test_model.py).

The view reads the weights through their storage: an update in place (`copy_weights`, an optimizer step, vLLM's
`load_weights`) is seen; a replaced tensor (`load_pretrained`, `.to()`, `lora.attach`) is not, and needs a new
view (`DecodeGraphs` keys its view on the tensors' addresses, as it keys its CUDA graphs). Run a view under the
kernel modes it was built in.
"""

from __future__ import annotations

import torch

from ..kernels import attention_with_cache, get_mode, linear, rope_cache_write, silu_mul, swiglu_product
from .transformer import MLP, Attention, CausalLM, KVCache, Linear, PagedKVCache


def _packed_product(proj, packed: tuple[torch.Tensor, torch.Tensor | None]):
    """x -> the packed projections' outputs side by side: `linear` over the packed weight for the model's own
    `Linear`s, the projections' own packed product for another kind (the fp8 sampler's W8A8 product)."""
    if isinstance(proj, Linear):
        weight, bias = packed
        return lambda x: linear(x, weight, bias)
    return proj.packed_product(*packed)


class _SeparateAttention:
    """q, k and v through their own modules (adapters run unmerged), the norm modules, rope, the cache's attention."""

    def __init__(self, attn: Attention):
        self.attn = attn

    def __call__(self, x, cos, sin, seq_lens, cache, layer, start, end):
        a, (b, t, _) = self.attn, x.shape                                   # x [B, T, H]
        q = a.q_proj(x).view(b, t, a.hq, a.d)                               # [B, T, Hq, D]
        k = a.k_proj(x).view(b, t, a.hkv, a.d)                              # [B, T, Hkv, D]
        v = a.v_proj(x).view(b, t, a.hkv, a.d)
        q, k = a.norm_rotate(q, k, cos, sin)
        return a.attend(q, k, v, seq_lens, cache, layer, start, end)


class _PackedAttention:
    """q, k and v as one product over the packed weights (the same bits: each output column is its own chain of
    k-steps), then as `_SeparateAttention`."""

    def __init__(self, attn: Attention, qkv: tuple[torch.Tensor, torch.Tensor | None]):
        self.attn, self.product = attn, _packed_product(attn.q_proj, qkv)
        self.widths = [attn.hq * attn.d, attn.hkv * attn.d, attn.hkv * attn.d]

    def project(self, x):
        a, (b, t, _) = self.attn, x.shape
        q, k, v = self.product(x).split(self.widths, dim=-1)               # strided column views
        return q.view(b, t, a.hq, a.d), k.view(b, t, a.hkv, a.d), v.view(b, t, a.hkv, a.d)

    def __call__(self, x, cos, sin, seq_lens, cache, layer, start, end):
        a = self.attn
        q, k, v = self.project(x)
        if a.qk_norm:  # the norm reads rows of one stride; rope and attention take any strides
            q, k = q.contiguous(), k.contiguous()
        q, k = a.norm_rotate(q, k, cos, sin)
        return a.attend(q, k, v, seq_lens, cache, layer, start, end)


class _FusedAttention(_PackedAttention):
    """One q/k/v product, then q/k's norm and rotation and the K/V write into a static cache in one kernel
    (`rope_cache_write`, the bits of invariant norm and rope), then attention over the cache."""

    def __call__(self, x, cos, sin, seq_lens, cache: KVCache, layer, start, end):
        a, (b, t, _) = self.attn, x.shape
        q, k, v = self.project(x)
        norms = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.qk_norm else ()
        q = rope_cache_write(q, k, v, cos, sin, cache.k[layer], cache.v[layer], start, *norms)
        o = attention_with_cache(q, cache.k[layer], cache.v[layer], start, end)
        return a.o_proj(o.reshape(b, t, a.hq * a.d))


class _PackedMLP:
    """gate and up as one product over the packed weights, then silu_mul on its halves and down_proj."""

    def __init__(self, mlp: MLP, gate_up: tuple[torch.Tensor, None]):
        self.mlp, self.gate_up = mlp, gate_up[0]                            # gate_up [2I, H]
        self.product = _packed_product(mlp.gate_proj, gate_up)

    def __call__(self, x):
        gate, up = self.product(x).chunk(2, dim=-1)                        # silu_mul reads strided halves
        return self.mlp.down_proj(silu_mul(gate, up))


class _SwigluMLP(_PackedMLP):
    """A decode step's gate and up products each leave most SMs idle at batch 64; as one product they fill them,
    and at decode sizes silu_mul runs in that product's epilogue (`swiglu_product`, the same bits)."""

    def __call__(self, x):
        fused = swiglu_product(x, self.gate_up)                              # [B, T, I], or None: not here
        return super().__call__(x) if fused is None else self.mlp.down_proj(fused)


class DecodingModel:
    """`model`'s prefill and decode steps on the paths chosen when this is built (see the module docstring)."""

    def __init__(self, model: CausalLM):
        self.model = model
        swiglu = get_mode("linear") == "invariant" and get_mode("silu_mul") == "invariant"
        self.static, self.paged = [], []
        """Per layer (attention, mlp) over a static `KVCache`, and over a `PagedKVCache`."""
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = attn.packed(), mlp.packed()
            if qkv is None:
                static = paged = _SeparateAttention(attn)
            else:
                paged = _PackedAttention(attn, qkv)
                static = _FusedAttention(attn, qkv) if attn.fuses() else paged
            if gate_up is not None:
                fused = swiglu and isinstance(mlp.gate_proj, Linear)        # the epilogue of `linear`'s product
                mlp = (_SwigluMLP if fused else _PackedMLP)(mlp, gate_up)
            self.static.append((static, mlp))
            self.paged.append((paged, mlp))

    @property
    def config(self):
        return self.model.config

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight

    def hidden_states(self, input_ids, seq_lens, cache: KVCache, start) -> torch.Tensor:
        """Final-norm hidden states [B, T, H] of a step against a static cache (`CausalLM.hidden_states`)."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"DecodingModel.hidden_states runs steps against a KVCache, got {type(cache).__name__}; "
                            "a forward without a cache is the model's own")
        return self.model.hidden_states(input_ids, seq_lens, cache, start, sublayers=self.static)

    def hidden_states_paged(self, input_ids, positions, cache: PagedKVCache) -> torch.Tensor:
        """Final-norm hidden states [N, H] of a flattened step over a paged cache (`CausalLM.hidden_states_paged`)."""
        return self.model.hidden_states_paged(input_ids, positions, cache, sublayers=self.paged)

    def __call__(self, input_ids, seq_lens, cache: KVCache, start) -> torch.Tensor:
        """Logits [B, T, V] of a prefill or decode step (`CausalLM.forward` with a cache)."""
        return linear(self.hidden_states(input_ids, seq_lens, cache, start), self.lm_head_weight)

"""The generator's view of a model: its prefill and decode steps with their fast paths chosen once.

`CausalLM`'s own forward is the training forward, one path: each projection its own product. `DecodingModel`, built
from a model by what generates with it (`generate`'s `DecodeGraphs`, vLLM's `WorkbenchCausalLM`), picks per layer,
from the weights' layout and the kernel modes in force when it is built:
- q/k/v as one product and gate/up as another, where `CausalLM.pack` laid their weights out in one buffer and no
  adapter or hook sits on them (`packing.py`); else each projection's own module (LoRA, a model moved by `.to()`);
- over a static `KVCache`, with invariant norm and rope: q/k's norm and rotation and the cache write in one kernel
  (`rope_cache_write`), then attention over the cache; where the norm also runs in the q/k/v product's prologue
  (below), that kernel's work runs in the product's epilogue (`rms_norm_qkv_rope_cache`, at decode sizes);
- with invariant linear and silu_mul: silu_mul in the gate/up product's epilogue (`swiglu_product`, at the sizes
  it covers: decode steps);
- with invariant linear and rms_norm: the residual add and RMSNorm before a packed product in that product's
  prologue (`rms_norm_linear`, `rms_norm_swiglu_product` with the above; at the sizes they cover: decode steps;
  not with a bias; for latency-bound products: `norm_linear.prologue_pays`).
In invariant mode every path has the training forward's bits (the fused kernels' contracts, tests/test_model.py).

The view reads the weights through their storage: an update in place (`copy_weights`, an optimizer step, vLLM's
`load_weights`) is seen; a replaced tensor (`load_pretrained`, `.to()`, `lora.attach`) is not, and needs a new
view (`DecodeGraphs` keys its view on the tensors' addresses, as it keys its CUDA graphs). Run a view under the
kernel modes it was built in.
"""

from __future__ import annotations

import torch

from ..kernels import (
    attention_with_cache, get_mode, linear, rms_norm_linear, rms_norm_qkv_rope_cache, rms_norm_swiglu_product,
    rope_cache_write, silu_mul, swiglu_product,
)
from ..kernels.norm_linear import prologue_pays
from .transformer import MLP, Attention, CausalLM, KVCache, PagedKVCache


class _SeparateAttention:
    """The norm module, then q, k and v through their own modules (adapters run unmerged), the norm modules, rope,
    the cache's attention."""

    def __init__(self, attn: Attention):
        self.attn = attn

    def __call__(self, norm, x, residual, cos, sin, seq_lens, cache, layer, start, end):
        a = self.attn
        x, residual = norm.stream(x, residual)
        b, t, _ = x.shape                                                   # x [B, T, H]
        q = a.q_proj(x).view(b, t, a.hq, a.d)                               # [B, T, Hq, D]
        k = a.k_proj(x).view(b, t, a.hkv, a.d)                              # [B, T, Hkv, D]
        v = a.v_proj(x).view(b, t, a.hkv, a.d)
        q, k = a.norm_rotate(q, k, cos, sin)
        return a.attend(q, k, v, seq_lens, cache, layer, start, end), residual


def _norm_then(fused: bool, norm, x, residual, weight, bias=None):
    """(product of norm(h), h) of the stream h = x + residual: with `fused`, the norm in the product's prologue
    (`rms_norm_linear`, the same bits) where it applies (decode sizes), else the norm, then the product."""
    out = rms_norm_linear(x, residual, norm.weight, weight, norm.eps) if fused else None
    if out is not None:
        return out
    h, residual = norm.stream(x, residual)
    return linear(h, weight, bias), residual


class _PackedAttention:
    """The norm, q, k and v as one product over the packed weights (the same bits: each output column is its own
    chain of k-steps), then as `_SeparateAttention`. fuse_norm: the norm in that product's prologue (no bias)."""

    def __init__(self, attn: Attention, qkv: tuple[torch.Tensor, torch.Tensor | None], fuse_norm: bool):
        self.attn, self.qkv, self.fuse_norm = attn, qkv, fuse_norm and qkv[1] is None
        self.widths = [attn.hq * attn.d, attn.hkv * attn.d, attn.hkv * attn.d]

    def project(self, norm, x, residual):
        a, (b, t, _) = self.attn, x.shape
        y, residual = _norm_then(self.fuse_norm, norm, x, residual, *self.qkv)
        q, k, v = y.split(self.widths, dim=-1)                              # strided column views
        return q.view(b, t, a.hq, a.d), k.view(b, t, a.hkv, a.d), v.view(b, t, a.hkv, a.d), residual

    def __call__(self, norm, x, residual, cos, sin, seq_lens, cache, layer, start, end):
        a = self.attn
        q, k, v, residual = self.project(norm, x, residual)
        if a.qk_norm:  # the norm reads rows of one stride; rope and attention take any strides
            q, k = q.contiguous(), k.contiguous()
        q, k = a.norm_rotate(q, k, cos, sin)
        return a.attend(q, k, v, seq_lens, cache, layer, start, end), residual


class _FusedAttention(_PackedAttention):
    """The norm and one q/k/v product, then q/k's norm and rotation and the K/V write into a static cache in one
    kernel (`rope_cache_write`, the bits of invariant norm and rope), then attention over the cache. With fuse_norm,
    all of it one launch where it applies (decode sizes): the norm in the product's prologue, the rest in its
    epilogue (`rms_norm_qkv_rope_cache`, the same bits)."""

    def __call__(self, norm, x, residual, cos, sin, seq_lens, cache: KVCache, layer, start, end):
        a, (b, t, _) = self.attn, x.shape
        qk = (a.q_norm.weight, a.k_norm.weight) if a.qk_norm else (None, None)
        qk_eps = a.q_norm.eps if a.qk_norm else norm.eps
        fused = rms_norm_qkv_rope_cache(x, residual, norm.weight, self.qkv[0], a.hq, a.hkv, cos, sin, cache.k[layer],
                                        cache.v[layer], start, *qk, norm.eps, qk_eps) if self.fuse_norm else None
        if fused is not None:
            q, residual = fused
        else:
            q, k, v, residual = self.project(norm, x, residual)
            q = rope_cache_write(q, k, v, cos, sin, cache.k[layer], cache.v[layer], start, *qk, qk_eps)
        o = attention_with_cache(q, cache.k[layer], cache.v[layer], start, end)
        return a.o_proj(o.reshape(b, t, a.hq * a.d)), residual


class _SeparateMLP:
    """The norm, then the MLP module (its own gate and up products)."""

    def __init__(self, mlp: MLP):
        self.mlp = mlp

    def __call__(self, norm, x, residual):
        h, residual = norm.stream(x, residual)
        return self.mlp(h), residual


class _PackedMLP:
    """The norm, gate and up as one product over the packed weights, then silu_mul on its halves and down_proj.
    fuse_norm: the norm in that product's prologue."""

    def __init__(self, mlp: MLP, gate_up: torch.Tensor, fuse_norm: bool):
        self.mlp, self.gate_up, self.fuse_norm = mlp, gate_up, fuse_norm  # gate_up [2I, H]

    def __call__(self, norm, x, residual):
        y, residual = _norm_then(self.fuse_norm, norm, x, residual, self.gate_up)
        gate, up = y.chunk(2, dim=-1)                                       # silu_mul reads strided halves
        return self.mlp.down_proj(silu_mul(gate, up)), residual


class _SwigluMLP(_PackedMLP):
    """A decode step's gate and up products each leave most SMs idle at batch 64; as one product they fill them,
    and at decode sizes silu_mul runs in that product's epilogue (`swiglu_product`, the same bits), and with
    fuse_norm the norm in its prologue too (`rms_norm_swiglu_product`)."""

    def __call__(self, norm, x, residual):
        fused = rms_norm_swiglu_product(x, residual, norm.weight, self.gate_up, norm.eps) if self.fuse_norm else None
        if fused is not None:
            act, residual = fused
            return self.mlp.down_proj(act), residual
        h, residual = norm.stream(x, residual)
        act = swiglu_product(h, self.gate_up)                               # [B, T, I], or None: not here
        if act is None:
            gate, up = linear(h, self.gate_up).chunk(2, dim=-1)
            act = silu_mul(gate, up)
        return self.mlp.down_proj(act), residual


class DecodingModel:
    """`model`'s prefill and decode steps on the paths chosen when this is built (see the module docstring)."""

    def __init__(self, model: CausalLM):
        self.model = model
        invariant = get_mode("linear") == "invariant"
        swiglu = invariant and get_mode("silu_mul") == "invariant"
        fuse_norm = invariant and get_mode("rms_norm") == "invariant"
        self.static, self.paged = [], []
        """Per layer (attention, mlp) over a static `KVCache`, and over a `PagedKVCache`."""
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = attn.packed(), mlp.packed()
            if qkv is None:
                static = paged = _SeparateAttention(attn)
            else:
                norm = fuse_norm and prologue_pays(*qkv[0].shape)
                paged = _PackedAttention(attn, qkv, norm)
                static = _FusedAttention(attn, qkv, norm) if attn.fuses() else paged
            if gate_up is None:
                mlp = _SeparateMLP(mlp)
            else:
                norm = fuse_norm and prologue_pays(*gate_up[0].shape)
                mlp = (_SwigluMLP if swiglu else _PackedMLP)(mlp, gate_up[0], norm)
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

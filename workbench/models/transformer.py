"""One decoder-only transformer for the Llama, Mistral, Qwen2 and Qwen3 families, built only from
`workbench.kernels` ops, so `mode(...)` switches every op.

The families differ only in config flags (`ModelConfig`): per-head q/k RMSNorm (Qwen3), q/k/v
biases (Qwen2), tied or untied embeddings, the RoPE base and scaling, the head width.

The same module serves the trainer (a full forward over a right-padded batch, or over
sequences packed end to end without padding: `PackedSequences`) and the generator
(prefill and decode against a static, preallocated KV cache): in `invariant` mode a
token's logits are the same bits every way. Its own forward has one path, each
projection its own product; the generator's fast paths (packed products, fused
kernels) are chosen once, by the view it holds (`decoding.DecodingModel`).

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`),
so a HF state dict loads as is; see `checkpoint.py` for files, `titan/weights.py` for torchtitan names.
LoRA adapters (`lora.py`) hook into `Linear`: the trainer and the generator both run them unmerged.
Shapes in comments: B batch, T new tokens, S cache length, H hidden, I
intermediate, Hq/Hkv heads, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import (
    apply_rope,
    attention,
    attention_paged,
    attention_varlen,
    attention_with_cache,
    current_state,
    embedding,
    get_mode,
    linear,
    lora_add,
    mode,
    norm_rope,
    paged_kv_write,
    rms_norm,
    rms_norm_add,
    rope_cos_sin,
    rope_inv_freq,
    silu_mul,
)
from .config import RECOMPUTE, ModelConfig, config
from .packing import pack_projections, packed_projections


@dataclass
class KVCache:
    """Static, preallocated keys and values of every layer (gpt-fast style)."""

    k: torch.Tensor  # [L, B, S, Hkv, D]
    v: torch.Tensor  # [L, B, S, Hkv, D]

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, max_len: int, device, dtype=torch.bfloat16) -> KVCache:
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def attend(self, layer: int, q, k, v, start, end):
        """Write the step's K/V at positions start[b] + i, then attend to each row's first end[b] keys."""
        b, t = q.shape[:2]                                                   # q [B, T, Hq, D]
        rows = torch.arange(b, device=q.device)[:, None]                    # [B, 1]
        pos = start[:, None] + torch.arange(t, device=q.device)             # [B, T]
        self.k[layer][rows, pos] = k
        self.v[layer][rows, pos] = v
        return attention_with_cache(q, self.k[layer], self.v[layer], start, end)


@dataclass
class PagedKVCache:
    """One step of a flattened batch over keys/values kept in pages (how vLLM runs a model).

    The step's N new tokens of S sequences come as one row [1, N]: sequence s owns rows
    cu_q[s]:cu_q[s+1], the last positions of its kv_len[s] keys (a prefill, a chunk of one, or a
    decode step). Key j of sequence s sits in page block_table[s, j // page_size], slot j % page_size.
    """

    pages: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v [P, page_size, Hkv, D]
    cu_q: torch.Tensor         # [S + 1] int32
    kv_len: torch.Tensor       # [S] int32
    block_table: torch.Tensor  # [S, max_pages] int32
    slots: torch.Tensor        # [N'] where the new tokens' K/V go (page * page_size + slot; < 0: skip)
    max_q: int
    """The most new tokens of one sequence in this step."""

    def attend(self, layer: int, q, k, v, start, end):
        kp, vp = self.pages[layer]
        paged_kv_write(k[0], v[0], kp, vp, self.slots)                     # k, v [1, N, Hkv, D]
        return attention_paged(q[0], kp, vp, self.block_table, self.cu_q, self.kv_len, self.max_q)[None]


@dataclass
class PackedSequences:
    """A training forward's sequences packed end to end in one row [1, N], without padding (the trainer's
    micro-batches cut by real tokens): sequence s is tokens cu_seqlens[s]:cu_seqlens[s+1]. Every op but attention
    is row-wise and attention is `attention_varlen`, so in `invariant` mode a token gets the bits of a padded
    forward (and of the generator)."""

    cu_seqlens: torch.Tensor  # [S + 1] int32
    positions: torch.Tensor   # [N] each token's position in its own sequence (RoPE's)
    max_len: int
    """The longest sequence (the attention kernel's grid)."""


class Linear(nn.Module):
    """y = x @ W.T (+ b) on the kernel library; with a LoRA adapter attached (`lora.attach`), unmerged,
    + scale * (x @ A.T) @ B.T through `kernels.lora_add`."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None
        self.register_parameter("lora_A", None)   # [r, in]
        self.register_parameter("lora_B", None)   # [out, r]
        self.lora_scale = 0.0

    def forward(self, x):
        y = linear(x, self.weight, self.bias)
        if self.lora_A is None:
            return y
        return lora_add(y, linear(linear(x, self.lora_A), self.lora_B), self.lora_scale)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def add(self, x, residual):
        """(norm(x + residual), x + residual): the residual stream's add fused into its norm (same bits)."""
        return rms_norm_add(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.hq * self.d, cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.hkv * self.d, cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.hkv * self.d, cfg.attention_bias)
        self.o_proj = Linear(self.hq * self.d, cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def pack(self) -> None:
        """q/k/v's weights (and biases) in one buffer (`pack_projections`): one product in the generator's forward
        (`DecodingModel`)."""
        pack_projections((self.q_proj, self.k_proj, self.v_proj))

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight [Nq + 2 Nkv, H], bias) over q/k/v's packed parameters, or None (`packed_projections`): the
        narrow k and v products of a decode step are mostly fixed cost."""
        return packed_projections((self.q_proj, self.k_proj, self.v_proj))

    def fuses(self) -> bool:
        """Whether the modes in force are the ones `norm_rope` and `rope_cache_write` have the bits of (invariant
        norm and rope)."""
        return get_mode("apply_rope") == "invariant" and (not self.qk_norm or get_mode("rms_norm") == "invariant")

    def forward(self, x, cos, sin, seq_lens, cache=None, layer=0, start=None, end=None):
        """The training forward, each projection its own product (also the reference forward against a cache;
        the generator runs `DecodingModel`'s). end: start + seq_lens with a cache, added once per forward rather
        than once per layer (each add is a launch of its own in a decode step)."""
        b, t, _ = x.shape                                                   # x [B, T, H]
        q = self.q_proj(x).view(b, t, self.hq, self.d)                      # [B, T, Hq, D]
        k = self.k_proj(x).view(b, t, self.hkv, self.d)                     # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, self.hkv, self.d)                     # [B, T, Hkv, D]
        if self.qk_norm and self.fuses():
            # Norm and rotation in one pass each way, the unfused ops' bits.
            q = norm_rope(q, self.q_norm.weight, cos, sin, self.q_norm.eps)
            k = norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps)
        else:
            q, k = self.norm_rotate(q, k, cos, sin)
        return self.attend(q, k, v, seq_lens, cache, layer, start, end)

    def norm_rotate(self, q, k, cos, sin):
        """q and k through the norm modules (qk_norm), then rotated (cos, sin [B, T, D/2])."""
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def attend(self, q, k, v, seq_lens, cache, layer, start, end):
        """Attention over the batch (no cache; seq_lens a `PackedSequences` for a packed row) or the cache (the
        step's K/V written, then read), then o_proj."""
        b, t = q.shape[:2]
        if isinstance(seq_lens, PackedSequences):                           # q [1, N, Hq, D]
            o = attention_varlen(q[0], k[0], v[0], seq_lens.cu_seqlens, seq_lens.max_len)[None]
        elif cache is None:
            o = attention(q, k, v, seq_lens)                                # [B, T, Hq, D]
        else:
            o = cache.attend(layer, q, k, v, start, end)
        return self.o_proj(o.reshape(b, t, self.hq * self.d))               # [B, T, H]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def pack(self) -> None:
        """gate's and up's weights in one buffer (`pack_projections`): one product in the generator's forward."""
        pack_projections((self.gate_proj, self.up_proj))

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight [2I, H], bias) over gate's and up's packed parameters, or None (`packed_projections`)."""
        return packed_projections((self.gate_proj, self.up_proj))

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))  # [B, T, I] -> [B, T, H]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, seq_lens, cache=None, layer=0, start=None, recompute_mlp=False,
                end=None, sublayers=None):
        """The residual stream as (x, residual), the stream being x + residual: each add is fused into the
        norm that reads its sum (`RMSNorm.add`), one pass over the rows instead of two, the same bits as
        `h = h + sublayer(norm(h))`. Layer 0 gets residual None (the stream is the embeddings).

        recompute_mlp: keep only the MLP's input and recompute its products in the backward.
        sublayers: (attention, mlp) to run instead of this layer's modules (`DecodingModel`'s paths)."""
        attn, mlp = (self.self_attn, self.mlp) if sublayers is None else sublayers
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        x = attn(h, cos, sin, seq_lens, cache, layer, start, end)
        h, residual = self.post_attention_layernorm.add(x, residual)
        if recompute_mlp:
            return checkpoint(mlp, h, use_reentrant=False, context_fn=same_mode()), residual
        return mlp(h), residual


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The decoder with its LM head; `forward` returns logits in the weights' dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.lora = None  # the LoraConfig of attached adapters (`lora.attach`), or None
        self.lora_flat = None  # the one buffer the adapters are views of (`lora.adapter_flat`)
        self.lora_modules = None  # the adapted projections, in the buffer's order
        self.model = DecoderStack(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> CausalLM:
        """Random weights (normal(0, std), norms at 1, biases normal too), drawn on the CPU in fp32, so any
        device gets the same."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def pack(self) -> CausalLM:
        """Every attention's q/k/v weights in one buffer, and every MLP's gate/up weights in another
        (`pack_projections`): one product for each group in the generator's forward (`DecodingModel`)."""
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        return self

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE frequencies [D/2] fp32, computed where they are used (on the trainer's and the
        generator's device alike, so both get the same bits; a few tiny ops, capturable in a CUDA graph)."""
        cfg = self.config
        scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling, device=device)

    def hidden_states(self, input_ids, seq_lens=None, cache: KVCache | None = None, start=None,
                      recompute: str = "none", sublayers=None, packed: PackedSequences | None = None):
        """Final-norm hidden states [B, T, H]; see `forward`. sublayers: per layer the (attention, mlp) to run
        instead of its modules (`DecodingModel`'s paths). packed: input_ids [1, N] are the sequences `packed`
        describes, end to end (a training forward without padding; no seq_lens, cache or start).

        recompute (training forwards): what the backward recomputes instead of keeping. 'none'; 'mlp': each
        MLP's gate/up products and silu(gate)*up (at the 1.7B shape half the activations, for ~15% more
        compute); 'layers': each whole decoder layer from its input (the least memory, ~1/3 more compute).
        The recomputation runs the same kernels in the same mode, so the gradients are the same bits.
        """
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        if recompute != "none" and cache is not None:
            raise ValueError("recompute is for training forwards; a KV cache forward has no backward")
        b, t = input_ids.shape                                              # input_ids [B, T]
        dev = input_ids.device
        if start is not None and cache is None:
            raise ValueError("start positions need a KV cache (a forward without one starts at position 0)")
        if packed is not None:
            if b != 1 or seq_lens is not None or cache is not None or packed.positions.shape != (t,):
                raise ValueError(f"a packed forward takes input_ids [1, N] and {t} positions alone (no seq_lens, "
                                 f"cache or start); got input_ids {tuple(input_ids.shape)}, positions "
                                 f"{tuple(packed.positions.shape)}")
            seq_lens, positions = packed, packed.positions[None]           # [1, N]
        else:
            if seq_lens is None:
                seq_lens = torch.full((b,), t, device=dev, dtype=torch.int32)
            if start is None:
                start = torch.zeros(b, device=dev, dtype=torch.int32)
            positions = start[:, None] + torch.arange(t, device=dev)        # [B, T]
        cos, sin = rope_cos_sin(positions, self.inv_freq(dev))             # [B, T, D/2] fp32
        x, residual = embedding(input_ids, self.model.embed_tokens.weight), None  # [B, T, H]
        end = None if cache is None else start + seq_lens                   # [B]: each row's keys after the step
        for i, layer in enumerate(self.model.layers):
            # Without autograd `checkpoint` runs the layer as it is (it keeps nothing to recompute).
            if recompute == "layers":
                x, residual = checkpoint(layer, x, residual, cos, sin, seq_lens, use_reentrant=False,
                                         context_fn=same_mode())
            else:
                x, residual = layer(x, residual, cos, sin, seq_lens, cache, i, start,
                                    recompute_mlp=recompute == "mlp", end=end,
                                    sublayers=None if sublayers is None else sublayers[i])
        return self.model.norm.add(x, residual)[0]

    def hidden_states_paged(self, input_ids, positions, cache: PagedKVCache, sublayers=None):
        """Final-norm hidden states [N, H] of a flattened step (input_ids, positions [N]) over a paged cache;
        sublayers as in `hidden_states`.

        In `invariant` mode row n has the bits the training forward gives that token.
        """
        cos, sin = rope_cos_sin(positions[None], self.inv_freq(positions.device))  # [1, N, D/2] fp32
        x, residual = embedding(input_ids, self.model.embed_tokens.weight)[None], None  # [1, N, H]
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, None, cache, i, None,
                                sublayers=None if sublayers is None else sublayers[i])
        return self.model.norm.add(x, residual)[0][0]

    def forward(self, input_ids, seq_lens=None, cache: KVCache | None = None, start=None):
        """Logits [B, T, V].

        Without a cache: a training forward over a right-padded batch (row b has
        seq_lens[b] real tokens, default all). With a cache: the tokens sit at
        positions start[b] + i; their K/V are written into the cache and they
        attend to the cache's first start[b] + seq_lens[b] entries (a prefill
        when start is 0, a decode step when T is 1). The caller keeps
        start + T <= cache.max_len.
        """
        return linear(self.hidden_states(input_ids, seq_lens, cache, start), self.lm_head_weight)


def same_mode():
    """checkpoint's context_fn: the recomputation runs under the kernel mode of the forward. (The backward may
    run on autograd's device thread, where the mode ContextVar holds its default.)"""
    state = current_state()

    def contexts():
        return contextlib.nullcontext(), mode(state.default, **state.overrides)

    return contexts


def build(cfg: ModelConfig | str, device="cpu", dtype=torch.bfloat16, seed: int | None = 0) -> CausalLM:
    """A model of the given size with random weights (seed) or uninitialised ones (seed=None).

    Built on the meta device and allocated once in `dtype` on `device`: no throw-away initialisation
    (nn.Embedding's own costs seconds at a 150k vocabulary). The random weights are drawn on the CPU in
    fp32 and cast by `copy_`, so every device and dtype gets the same draws.
    """
    cfg = config(cfg) if isinstance(cfg, str) else cfg
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
    if str(device) != "meta":
        model = model.to_empty(device=device)
        model.pack()
    if seed is not None:
        model.init_weights(seed)
    return model


def check_weights(src: dict[str, torch.Tensor], model: nn.Module) -> None:
    """A KeyError naming missing or unexpected names, or a ValueError naming a shape, unless `src` fits `model`."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(src))
    unexpected = sorted(set(src) - set(params))
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, p in params.items():
        if src[name].shape != p.shape:
            raise ValueError(f"{name}: the model has shape {tuple(p.shape)}, the weights {tuple(src[name].shape)}")


def copy_weights(src: dict[str, torch.Tensor], model: nn.Module) -> None:
    """The one cast path from (fp32 master) weights into the model's dtype: `copy_`, round to nearest even."""
    check_weights(src, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src[name])

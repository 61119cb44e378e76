"""One decoder-only transformer for the Llama, Mistral, Qwen2 and Qwen3 families, built only from
`workbench.kernels` ops, so `mode(...)` switches every op.

The families differ only in config flags (`ModelConfig`): per-head q/k RMSNorm (Qwen3), q/k/v
biases (Qwen2), tied or untied embeddings, the RoPE base and scaling, the head width.

The same module serves the trainer (a full forward over a right-padded batch)
and the generator (prefill and decode against a static, preallocated KV cache):
in `invariant` mode a token's logits are the same bits either way.

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`),
so a HF state dict loads as is; see `checkpoint.py` for files and torchtitan names.
LoRA adapters (`lora.py`) hook into `Linear`: the trainer and the generator both run them unmerged.
Shapes in comments: B batch, T new tokens, S cache length, H hidden, I
intermediate, Hq/Hkv heads, D head dim, V vocab.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import (
    apply_rope,
    attention,
    attention_paged,
    attention_with_cache,
    current_state,
    linear,
    lora_add,
    mode,
    paged_kv_write,
    rms_norm,
    rms_norm_add,
    rope_cos_sin,
    rope_inv_freq,
    silu_mul,
)


@dataclass(frozen=True)
class RopeScaling:
    """Hugging Face's `rope_scaling`, for the types the model supports (see `kernels.rope_inv_freq`)."""

    rope_type: str
    """'linear' or 'llama3'."""
    factor: float
    """How much longer the context is than the one the model was trained on."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / this are scaled by 1 / factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / this are left alone."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length of pre-training."""

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"RoPE scaling type {self.rope_type!r} is not supported; supported: linear, llama3")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("llama3 RoPE scaling needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")

    def to_hf(self) -> dict:
        """The dict Hugging Face configs hold (only the fields its type reads)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return asdict(self)


FAMILIES = ("qwen3", "qwen2", "llama", "mistral")
"""Hugging Face `model_type`s the model runs; each is a set of the flags below."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str = "qwen3"
    """The Hugging Face family (qwen3, qwen2, llama, mistral): what a saved checkpoint is declared as."""
    vocab_size: int = 151936
    """Tokens in the vocabulary."""
    hidden_size: int = 2048
    """Width of the residual stream."""
    intermediate_size: int = 6144
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int = 28
    """Decoder layers."""
    num_attention_heads: int = 16
    """Query heads."""
    num_key_value_heads: int = 8
    """Key/value heads (GQA groups)."""
    head_dim: int = 128
    """Width of one head (Hugging Face derives hidden_size / num_attention_heads where a config omits it)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling (Llama 3.x: 'llama3'; 'linear'); None: plain RoPE."""
    qk_norm: bool = True
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    attention_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    tie_word_embeddings: bool = True
    """lm_head shares the embedding matrix."""
    max_position_embeddings: int = 40960
    """Longest sequence the model is meant for."""

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise ValueError(f"ModelConfig.{f.name} must be positive, got {v}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    def to_dict(self) -> dict:
        return asdict(self)


def _qwen3(**kw) -> ModelConfig:
    return ModelConfig(model_type="qwen3", **kw)


SIZES: dict[str, ModelConfig] = {
    # Runs in the CPU interpreter in seconds (Qwen3's flags).
    "tiny": _qwen3(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    "qwen3-0.6B": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "qwen3-1.7B": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
    "qwen3-4B": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "qwen3-8B": _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       tie_word_embeddings=False),
    # SmolLM2-135M's shape (a Llama: no q/k norm, no biases, head_dim 64, GQA 3).
    "smollm2-135M": ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                rms_norm_eps=1e-5, rope_theta=100_000.0, qk_norm=False,
                                max_position_embeddings=8192),
    # Qwen2-0.5B's shape (q/k/v biases, GQA 7, head_dim 64).
    "qwen2-0.5B": ModelConfig(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, head_dim=64, qk_norm=False,
                              attention_bias=True, max_position_embeddings=32768),
}


def config(name: str) -> ModelConfig:
    """A named shape: 'tiny', 'qwen3-0.6B' ... 'qwen3-8B', 'smollm2-135M' or 'qwen2-0.5B'."""
    if name not in SIZES:
        raise ValueError(f"unknown model shape {name!r}; known shapes: {list(SIZES)}")
    return SIZES[name]


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

    def attend(self, layer: int, q, k, v, start, seq_lens):
        """Write the step's K/V at positions start[b] + i, then attend to each row's first start + seq_lens keys."""
        b, t = q.shape[:2]                                                   # q [B, T, Hq, D]
        rows = torch.arange(b, device=q.device)[:, None]                    # [B, 1]
        pos = start[:, None] + torch.arange(t, device=q.device)             # [B, T]
        self.k[layer][rows, pos] = k
        self.v[layer][rows, pos] = v
        return attention_with_cache(q, self.k[layer], self.v[layer], start, start + seq_lens)


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

    def attend(self, layer: int, q, k, v, start, seq_lens):
        kp, vp = self.pages[layer]
        paged_kv_write(k[0], v[0], kp, vp, self.slots)                     # k, v [1, N, Hkv, D]
        return attention_paged(q[0], kp, vp, self.block_table, self.cu_q, self.kv_len, self.max_q)[None]


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

    def forward(self, x, cos, sin, seq_lens, cache=None, layer=0, start=None):
        b, t, _ = x.shape                                                   # x [B, T, H]
        q = self.q_proj(x).view(b, t, self.hq, self.d)                      # [B, T, Hq, D]
        k = self.k_proj(x).view(b, t, self.hkv, self.d)                     # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, self.hkv, self.d)                     # [B, T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)             # cos, sin [B, T, D/2]
        if cache is None:
            o = attention(q, k, v, seq_lens)                                # [B, T, Hq, D]
        else:
            o = cache.attend(layer, q, k, v, start, seq_lens)               # K/V written, then read
        return self.o_proj(o.reshape(b, t, self.hq * self.d))               # [B, T, H]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))  # [B, T, I] -> [B, T, H]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, seq_lens, cache=None, layer=0, start=None):
        """The residual stream as (x, residual), the stream being x + residual: each add is fused into the
        norm that reads its sum (`RMSNorm.add`), one pass over the rows instead of two, the same bits as
        `h = h + sublayer(norm(h))`. Layer 0 gets residual None (the stream is the embeddings)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add(x, residual)
        x = self.self_attn(h, cos, sin, seq_lens, cache, layer, start)
        h, residual = self.post_attention_layernorm.add(x, residual)
        return self.mlp(h), residual


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

    def inv_freq(self, device) -> torch.Tensor:
        """RoPE frequencies [D/2] fp32, computed where they are used (on the trainer's and the
        generator's device alike, so both get the same bits; a few tiny ops, capturable in a CUDA graph)."""
        cfg = self.config
        scaling = cfg.rope_scaling.to_hf() if cfg.rope_scaling else None
        return rope_inv_freq(cfg.head_dim, cfg.rope_theta, scaling, device=device)

    def hidden_states(self, input_ids, seq_lens=None, cache: KVCache | None = None, start=None,
                      checkpoint_layers: bool = False):
        """Final-norm hidden states [B, T, H]; see `forward`.

        checkpoint_layers: keep only each decoder layer's input and recompute the layer in the backward
        (training only). The recomputation runs the same kernels in the same mode, so the gradients are the
        same bits as without it.
        """
        if checkpoint_layers and cache is not None:
            raise ValueError("checkpoint_layers is for training forwards; a KV cache forward has no backward")
        b, t = input_ids.shape                                              # input_ids [B, T]
        dev = input_ids.device
        if start is not None and cache is None:
            raise ValueError("start positions need a KV cache (a forward without one starts at position 0)")
        if seq_lens is None:
            seq_lens = torch.full((b,), t, device=dev, dtype=torch.int32)
        if start is None:
            start = torch.zeros(b, device=dev, dtype=torch.int32)
        positions = start[:, None] + torch.arange(t, device=dev)            # [B, T]
        cos, sin = rope_cos_sin(positions, self.inv_freq(dev))             # [B, T, D/2] fp32
        x, residual = self.model.embed_tokens(input_ids), None              # [B, T, H]
        for i, layer in enumerate(self.model.layers):
            if checkpoint_layers and torch.is_grad_enabled():
                x, residual = checkpoint(layer, x, residual, cos, sin, seq_lens, use_reentrant=False,
                                         context_fn=_same_mode())
            else:
                x, residual = layer(x, residual, cos, sin, seq_lens, cache, i, start)
        return self.model.norm.add(x, residual)[0]

    def hidden_states_paged(self, input_ids, positions, cache: PagedKVCache):
        """Final-norm hidden states [N, H] of a flattened step (input_ids, positions [N]) over a paged cache.

        In `invariant` mode row n has the bits the training forward gives that token.
        """
        cos, sin = rope_cos_sin(positions[None], self.inv_freq(positions.device))  # [1, N, D/2] fp32
        x, residual = self.model.embed_tokens(input_ids)[None], None        # [1, N, H]
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin, None, cache, i, None)
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


def _same_mode():
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

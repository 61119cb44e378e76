"""Qwen3, built only from `workbench.kernels` ops, so `mode(...)` switches every op.

The same module serves the trainer (a full forward over a right-padded batch)
and the generator (prefill and decode against a static, preallocated KV cache):
in `invariant` mode a token's logits are the same bits either way.

Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`),
so a HF state dict loads as is; see `checkpoint.py` for files and torchtitan names.
Shapes in comments: B batch, T new tokens, S cache length, H hidden, I
intermediate, Hq/Hkv heads, D head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from ..kernels import (apply_rope, attention, attention_paged, attention_with_cache, linear, paged_kv_write, rms_norm,
                       rope_cos_sin, silu_mul)


@dataclass(frozen=True)
class Qwen3Config:
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
    """Width of one head."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    tie_word_embeddings: bool = True
    """lm_head shares the embedding matrix."""
    max_position_embeddings: int = 40960
    """Longest sequence the model is meant for."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
                raise ValueError(f"Qwen3Config.{f.name} must be positive, got {v}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    def to_dict(self) -> dict:
        return asdict(self)


SIZES: dict[str, Qwen3Config] = {
    # Runs in the CPU interpreter in seconds.
    "tiny": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    "0.6B": Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "1.7B": Qwen3Config(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
    "4B": Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "8B": Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      tie_word_embeddings=False),
}


def config(name: str) -> Qwen3Config:
    """A named size: 'tiny', '0.6B', '1.7B', '4B' or '8B'."""
    if name not in SIZES:
        raise ValueError(f"unknown Qwen3 size {name!r}; known sizes: {list(SIZES)}")
    return SIZES[name]


@dataclass
class KVCache:
    """Static, preallocated keys and values of every layer (gpt-fast style)."""

    k: torch.Tensor  # [L, B, S, Hkv, D]
    v: torch.Tensor  # [L, B, S, Hkv, D]

    @classmethod
    def allocate(cls, cfg: Qwen3Config, batch: int, max_len: int, device, dtype=torch.bfloat16) -> KVCache:
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
    """y = x @ W.T on the kernel library (no bias: Qwen3 has none)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x):
        return linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.hq * self.d)
        self.k_proj = Linear(cfg.hidden_size, self.hkv * self.d)
        self.v_proj = Linear(cfg.hidden_size, self.hkv * self.d)
        self.o_proj = Linear(self.hq * self.d, cfg.hidden_size)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, seq_lens, cache=None, layer=0, start=None):
        b, t, _ = x.shape                                                   # x [B, T, H]
        q = self.q_norm(self.q_proj(x).view(b, t, self.hq, self.d))         # [B, T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(b, t, self.hkv, self.d))        # [B, T, Hkv, D]
        v = self.v_proj(x).view(b, t, self.hkv, self.d)                     # [B, T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)             # cos, sin [B, T, D/2]
        if cache is None:
            o = attention(q, k, v, seq_lens)                                # [B, T, Hq, D]
        else:
            o = cache.attend(layer, q, k, v, start, seq_lens)               # K/V written, then read
        return self.o_proj(o.reshape(b, t, self.hq * self.d))               # [B, T, H]


class MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))  # [B, T, I] -> [B, T, H]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, seq_lens, cache=None, layer=0, start=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, cache, layer, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 with its LM head; `forward` returns logits in the weights' dtype."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Qwen3ForCausalLM:
        """Random weights (normal(0, std), norms at 1), drawn on the CPU in fp32, so any device gets the same."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

    def hidden_states(self, input_ids, seq_lens=None, cache: KVCache | None = None, start=None):
        """Final-norm hidden states [B, T, H]; see `forward`."""
        b, t = input_ids.shape                                              # input_ids [B, T]
        dev = input_ids.device
        if start is not None and cache is None:
            raise ValueError("start positions need a KV cache (a forward without one starts at position 0)")
        if seq_lens is None:
            seq_lens = torch.full((b,), t, device=dev, dtype=torch.int32)
        if start is None:
            start = torch.zeros(b, device=dev, dtype=torch.int32)
        positions = start[:, None] + torch.arange(t, device=dev)            # [B, T]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # [B, T, D/2] fp32
        x = self.model.embed_tokens(input_ids)                              # [B, T, H]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, seq_lens, cache, i, start)
        return self.model.norm(x)

    def hidden_states_paged(self, input_ids, positions, cache: PagedKVCache):
        """Final-norm hidden states [N, H] of a flattened step (input_ids, positions [N]) over a paged cache.

        In `invariant` mode row n has the bits the training forward gives that token.
        """
        cos, sin = rope_cos_sin(positions[None], self.config.head_dim, self.config.rope_theta)  # [1, N, D/2]
        x = self.model.embed_tokens(input_ids)[None]                        # [1, N, H]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None, cache, i, None)
        return self.model.norm(x)[0]

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


def build(cfg: Qwen3Config | str, device="cpu", dtype=torch.bfloat16, seed: int | None = 0) -> Qwen3ForCausalLM:
    """A model of the given size with random weights (seed) or uninitialised ones (seed=None)."""
    cfg = config(cfg) if isinstance(cfg, str) else cfg
    model = Qwen3ForCausalLM(cfg)
    if seed is not None:
        model.init_weights(seed)
    return model.to(device=device, dtype=dtype)


def copy_weights(src: dict[str, torch.Tensor], model: nn.Module) -> None:
    """The one cast path from (fp32 master) weights into the model's dtype: `copy_`, round to nearest even."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(src))
    unexpected = sorted(set(src) - set(params))
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if src[name].shape != p.shape:
                raise ValueError(f"{name}: the model has shape {tuple(p.shape)}, the weights {tuple(src[name].shape)}")
            p.copy_(src[name])

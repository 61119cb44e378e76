"""The model's shape and family flags (`ModelConfig`), the named shapes (`SIZES`, `config`), and the
families the one model file runs (`FAMILIES`). Checkpoint formats read and write these in `checkpoint.py`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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

RECOMPUTE = ("none", "mlp", "layers")
"""What a training forward may leave for the backward to recompute (`CausalLM.hidden_states`)."""


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

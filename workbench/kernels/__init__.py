"""The kernel library: every op of the model (Llama, Mistral, Qwen2, Qwen3) in an `invariant` and a `standard` mode.

Import order matters on a CPU-only machine: `runtime` chooses the Triton
interpreter before any kernel is decorated.
"""

from . import runtime  # noqa: F401  (must come first)
from .runtime import interpreting, pdl
from .registry import REGISTRY, Op  # before the op functions below shadow their modules' names
from .attention import attention, attention_with_cache
from .attention_paged import attention_paged, paged_kv_write
from .cumsum import row_cumsum
from .embedding import embedding
from .gumbel import gumbel_argmax
from .linear_logprobs import linear_logprobs
from .logprobs import entropy, logprob_rows, logsumexp, token_logprobs, token_logprobs_and_entropy
from .lora_add import lora_add
from .matmul import linear
from .matmul_tiles import matmul_config
from .norm_rope import norm_rope
from .mode import FUSED_ROWWISE, MODES, current_state, get_mode, mode, set_mode
from .rmsnorm import rms_norm, rms_norm_add
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from .rope_cache import rope_cache_write
from .silu_mul import silu_mul
from .swiglu_product import swiglu_product

__all__ = [
    "FUSED_ROWWISE",
    "MODES",
    "REGISTRY",
    "Op",
    "apply_rope",
    "attention",
    "attention_paged",
    "attention_with_cache",
    "current_state",
    "embedding",
    "entropy",
    "get_mode",
    "gumbel_argmax",
    "interpreting",
    "linear",
    "linear_logprobs",
    "logprob_rows",
    "logsumexp",
    "lora_add",
    "matmul_config",
    "mode",
    "norm_rope",
    "paged_kv_write",
    "pdl",
    "rms_norm",
    "rms_norm_add",
    "rope_cache_write",
    "rope_cos_sin",
    "rope_inv_freq",
    "row_cumsum",
    "set_mode",
    "silu_mul",
    "swiglu_product",
    "token_logprobs",
    "token_logprobs_and_entropy",
]

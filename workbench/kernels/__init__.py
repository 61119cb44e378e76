"""The kernel library: every op of the model (Llama, Mistral, Qwen2, Qwen3) in an `invariant` and a `standard` mode.

Every op, from `registry.REGISTRY` (a test holds this table to it). Contracts: "row-invariant", a row's bits
depend on that row alone; "the unfused ops' bits", those of the invariant ops it fuses; "exact", integers,
copies and correctly rounded fp32 steps only. Mode: "switch", a name of `mode(...)`; "follows", the switch's ops
that choose its path; "invariant only", a fused kernel callers take in invariant mode; "one path", the same in both
modes. Generic tests: tests/test_kernels.py (CPU) and tests/test_gpu.py.

| op | file | contract | mode | reference | tests |
|---|---|---|---|---|---|
| linear | matmul.py | row-invariant | switch | matmul.linear_reference | generic |
| rms_norm | rmsnorm.py | row-invariant | switch | rmsnorm.rms_norm_reference | generic |
| silu_mul | silu_mul.py | row-invariant | switch | silu_mul.silu_mul_reference | generic |
| apply_rope | rope.py | row-invariant | switch | rope.apply_rope_reference | generic |
| token_logprobs | logprobs.py | row-invariant | switch | logprobs.token_logprobs_reference | generic |
| attention | attention.py | row-invariant | switch | attention.attention_reference | test_attention.py |
| entropy | logprobs.py | row-invariant | switch | logprobs.entropy_reference | generic |
| lora_add | lora_add.py | row-invariant | switch | lora_add.lora_add_reference | test_lora.py |
| embedding | embedding.py | row-invariant | one path | embedding.embedding_reference | test_embedding.py |
| norm_rope | norm_rope.py | the unfused ops' bits | invariant only | norm_rope.norm_rope_reference | test_norm_rope.py |
| swiglu_product | swiglu_product.py | the unfused ops' bits | invariant only | swiglu_product.swiglu_product_reference | test_swiglu_product.py |
| linear_logprobs | linear_logprobs.py | the unfused ops' bits | follows linear, token_logprobs | linear_logprobs.linear_logprobs_reference | test_linear_logprobs.py |
| rope_cache_write | rope_cache.py | the unfused ops' bits | invariant only | rope_cache.rope_cache_write_reference | test_rope_cache.py |
| gumbel_argmax | gumbel.py | row-invariant | one path | gumbel.gumbel_argmax_reference | kernels/test_gumbel_argmax.py |
| attention_paged | attention_paged.py | row-invariant | follows attention | attention_paged.attention_paged_reference | kernels/test_attention_paged.py |
| attention_varlen | attention_varlen.py | row-invariant | follows attention | attention_varlen.attention_varlen_reference | kernels/test_attention_varlen.py |
| paged_kv_write | attention_paged.py | exact | one path | attention_paged.paged_kv_write_reference | kernels/test_attention_paged.py |
| row_cumsum | cumsum.py | row-invariant | one path | cumsum.row_cumsum_reference | kernels/test_row_cumsum.py |
| rms_norm_add | rmsnorm.py | row-invariant | follows rms_norm | rmsnorm.rms_norm_add_reference | kernels/test_rms_norm_add.py |
| logsumexp | logprobs.py | row-invariant | follows token_logprobs | logprobs.logsumexp_reference | kernels/test_logsumexp.py |
| logprob_rows | logprobs.py | row-invariant | follows token_logprobs | logprobs.logprob_rows_reference | kernels/test_logsumexp.py |
| record_add | record.py | exact | one path | record.record_add_reference | kernels/test_record_add.py |
| quantize_fp8 | quantize_fp8.py | exact | one path | quantize_fp8.quantize_fp8_reference | test_quantize_fp8.py |

Import order matters on a CPU-only machine: `runtime` chooses the Triton
interpreter before any kernel is decorated.
"""

from . import runtime  # noqa: F401  (must come first)
from .runtime import interpreting, pdl
from .registry import REGISTRY, Op  # before the op functions below shadow their modules' names
from .attention import attention, attention_with_cache
from .attention_paged import attention_paged, paged_kv_write
from .attention_varlen import attention_varlen
from .cumsum import row_cumsum
from .embedding import embedding
from .gumbel import gumbel_argmax
from .linear_logprobs import linear_logprobs
from .logprobs import entropy, logprob_rows, logsumexp, token_logprobs, token_logprobs_and_entropy
from .lora_add import lora_add
from .matmul import linear
from .matmul_tiles import matmul_config
from .norm_rope import norm_rope
from .quantize_fp8 import quantize_fp8
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
    "attention_varlen",
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
    "quantize_fp8",
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

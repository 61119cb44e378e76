"""The embedded generator: batched KV-cache sampling with per-token log-probs, and its parity with the trainer."""

from .generator import Completion, DecodeGraphs, GenerationOutput, generate
from .parity import (
    as_parity_table,
    format_report,
    parity_summary,
    parity_table,
    parity_triangle,
    random_prompts,
    trainer_logprobs,
)
from .sampling import SamplingParams, keep_mask, sample, sampled_logprobs, uniforms

__all__ = [
    "Completion",
    "DecodeGraphs",
    "GenerationOutput",
    "SamplingParams",
    "as_parity_table",
    "format_report",
    "generate",
    "keep_mask",
    "parity_summary",
    "parity_table",
    "parity_triangle",
    "random_prompts",
    "sample",
    "sampled_logprobs",
    "trainer_logprobs",
    "uniforms",
]

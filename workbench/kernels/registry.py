"""Every op of the kernel library, by name: its file, its numerics contract, whether the mode switch names it,
its fp64 (or PyTorch) reference, example inputs and its tests. The parity audit and the generic tests loop over
`REGISTRY`; `mode.OPS` is the ops it marks `mode_switch`.

The table names functions as "module.function" of this package, resolved when used: the mode switch, the lowest
layer, derives its op names from here, so this module imports no kernel (they all import the switch).

Each op is row-wise: the first dimension of every argument listed in `row_args`, and of the output, is the batch
of rows whose results must not depend on each other. Ops of another signature (in-place writes, tuples, a
flattened batch) are called through their row-major form in `examples.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

CONTRACTS = {
    "row-invariant": "a row's bits depend on that row alone: not on the batch, its place, the other rows or padding",
    "the unfused ops' bits": "the bits of the invariant ops it fuses, run one after the other (so row-invariant too)",
    "exact": "integers, copies and correctly rounded fp32 steps only: the PyTorch form's bits",
}
BOTH = (torch.float32, torch.bfloat16)


def resolve(ref: str) -> Callable:
    """The function "module.name" of this package."""
    module, name = ref.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _in_mode(fn: Callable, name: str) -> Callable:
    def run(*args):
        with resolve("mode.mode")(name):
            return fn(*args)
    run.__name__ = f"{getattr(fn, '__name__', 'op')}_{name}"
    return run


@dataclass(frozen=True)
class Op:
    name: str
    file: str
    """Its module in workbench/kernels."""
    contract: str
    """A key of CONTRACTS."""
    reference_fn: str
    """"module.function": the fp64 (or PyTorch) form, called with the op's own arguments."""
    inputs_fn: str
    """"module.function"(rows, size, generator, device, dtype) -> positional args."""
    row_args: tuple[int, ...]
    """Indices of the arguments whose first dimension is the row batch."""
    tests: tuple[str, ...]
    """The test files that hold it to its contract."""
    mode_switch: bool = False
    """A name of the mode switch: `<file>.<name>_invariant` and `_standard` are its two paths."""
    follows: tuple[str, ...] = ()
    """Without a switch of its own: the ops of the switch whose modes choose its path (the default, when empty:
    one path in every mode, or, with `unfused`, a fused kernel callers take in invariant mode only)."""
    run_fn: str | None = None
    """"module.function": the op called as the generic checks call it, when not a switch's paths."""
    unfused_fn: str | None = None
    """"module.function": the unfused invariant ops whose bits the contract "the unfused ops' bits" promises."""
    grad_args: tuple[int, ...] = ()
    """Indices of the arguments that get gradients."""
    tile_config_fn: str | None = None
    """"module.function" -> the launch config of its invariant kernels, for the environment record."""
    max_rows: int = 64
    """The largest batch the generic CPU tests draw (an attention row is a whole sequence)."""
    max_rows_gpu: int = 2048
    """The largest batch the GPU tests draw (the sizes where the op runs at all)."""
    dtypes: tuple[torch.dtype, ...] = BOTH
    """The dtypes it takes."""

    @property
    def invariant(self) -> Callable:
        if self.mode_switch:
            return resolve(f"{self.file}.{self.name}_invariant")
        return _in_mode(resolve(self.run_fn), "invariant")

    @property
    def standard(self) -> Callable | None:
        """The mismatched control's path; None for an op with one path, or served in invariant mode only."""
        if self.mode_switch:
            return resolve(f"{self.file}.{self.name}_standard")
        return _in_mode(resolve(self.run_fn), "standard") if self.follows else None

    @property
    def reference(self) -> Callable:
        return resolve(self.reference_fn)

    @property
    def make_inputs(self) -> Callable[..., tuple]:
        return resolve(self.inputs_fn)

    @property
    def unfused(self) -> Callable | None:
        return None if self.unfused_fn is None else _in_mode(resolve(self.unfused_fn), "invariant")

    def tile_config(self) -> dict:
        return {} if self.tile_config_fn is None else resolve(self.tile_config_fn)()


def _switched(name, file, inputs, row_args, grad_args, tests, tile_config_fn=None, **kw) -> Op:
    return Op(name, file, "row-invariant", f"{file}.{name}_reference", f"examples.{inputs}", row_args, tests,
              mode_switch=True, grad_args=grad_args, tile_config_fn=tile_config_fn or f"{file}.tile_config", **kw)


_GENERIC = ("tests/test_kernels.py", "tests/test_gpu.py")
REGISTRY: dict[str, Op] = {op.name: op for op in (
    _switched("linear", "matmul", "linear_inputs", (0,), (0, 1), _GENERIC, tile_config_fn="matmul_tiles.tile_config"),
    _switched("rms_norm", "rmsnorm", "rms_norm_inputs", (0,), (0, 1), _GENERIC),
    _switched("silu_mul", "silu_mul", "silu_mul_inputs", (0, 1), (0, 1), _GENERIC),
    _switched("apply_rope", "rope", "apply_rope_inputs", (0, 1, 2), (0,), _GENERIC),
    _switched("token_logprobs", "logprobs", "token_logprobs_inputs", (0, 1), (0,), _GENERIC),
    _switched("attention", "attention", "attention_inputs", (0, 1, 2, 3), (0, 1, 2),
              (*_GENERIC, "tests/test_attention.py"), max_rows=16),
    _switched("entropy", "logprobs", "logits_inputs", (0,), (0,), _GENERIC),
    _switched("lora_add", "lora_add", "lora_add_inputs", (0, 1), (0, 1), (*_GENERIC, "tests/test_lora.py")),
    Op("embedding", "embedding", "row-invariant", "embedding.embedding_reference", "examples.embedding_inputs",
       (0,), (*_GENERIC, "tests/test_embedding.py"), run_fn="embedding.embedding", grad_args=(1,)),
    Op("norm_rope", "norm_rope", "the unfused ops' bits", "norm_rope.norm_rope_reference",
       "examples.norm_rope_inputs", (0, 2, 3), (*_GENERIC, "tests/test_norm_rope.py"), run_fn="norm_rope.norm_rope",
       unfused_fn="examples.norm_rope_unfused", grad_args=(0, 1), tile_config_fn="norm_rope.tile_config"),
    Op("swiglu_product", "swiglu_product", "the unfused ops' bits", "swiglu_product.swiglu_product_reference",
       "examples.swiglu_product_inputs", (0,), (*_GENERIC, "tests/test_swiglu_product.py"),
       run_fn="examples.swiglu_product_rows", unfused_fn="examples.swiglu_product_unfused",
       dtypes=(torch.bfloat16,), max_rows_gpu=512),   # swiglu_product.MAX_ROWS: above it the unfused ops run
    Op("linear_logprobs", "linear_logprobs", "the unfused ops' bits", "examples.linear_logprobs_rows_reference",
       "examples.linear_logprobs_inputs", (0, 2), (*_GENERIC, "tests/test_linear_logprobs.py"),
       follows=("linear", "token_logprobs"), run_fn="examples.linear_logprobs_rows",
       unfused_fn="examples.linear_logprobs_unfused", grad_args=(0, 1), max_rows=16),
    Op("rope_cache_write", "rope_cache", "the unfused ops' bits", "examples.rope_cache_write_rows_reference",
       "examples.rope_cache_write_inputs", (0, 1, 2, 3, 4, 5), (*_GENERIC, "tests/test_rope_cache.py"),
       run_fn="examples.rope_cache_write_rows", unfused_fn="examples.rope_cache_write_unfused", max_rows=16),
    Op("gumbel_argmax", "gumbel", "row-invariant", "examples.gumbel_argmax_rows_reference",
       "examples.gumbel_argmax_inputs", (0, 1, 2), (*_GENERIC, "tests/kernels/test_gumbel_argmax.py"),
       run_fn="examples.gumbel_argmax_rows"),
    Op("attention_paged", "attention_paged", "row-invariant", "examples.attention_paged_rows_reference",
       "examples.attention_paged_inputs", (0, 1, 2), (*_GENERIC, "tests/kernels/test_attention_paged.py"),
       follows=("attention",), run_fn="examples.attention_paged_rows", max_rows=16),
    Op("attention_varlen", "attention_varlen", "row-invariant", "examples.attention_varlen_rows_reference",
       "examples.attention_inputs", (0, 1, 2, 3), (*_GENERIC, "tests/kernels/test_attention_varlen.py"),
       follows=("attention",), run_fn="examples.attention_varlen_rows", grad_args=(0, 1, 2),
       tile_config_fn="attention.tile_config", max_rows=16),
    Op("paged_kv_write", "attention_paged", "exact", "examples.paged_kv_write_rows_reference",
       "examples.paged_kv_write_inputs", (0, 1, 2), (*_GENERIC, "tests/kernels/test_attention_paged.py"),
       run_fn="examples.paged_kv_write_rows"),
    Op("row_cumsum", "cumsum", "row-invariant", "cumsum.row_cumsum_reference", "examples.row_cumsum_inputs", (0,),
       (*_GENERIC, "tests/kernels/test_row_cumsum.py"), run_fn="cumsum.row_cumsum"),
    Op("rms_norm_add", "rmsnorm", "row-invariant", "examples.rms_norm_add_rows_reference",
       "examples.rms_norm_add_inputs", (0, 1), (*_GENERIC, "tests/kernels/test_rms_norm_add.py"),
       follows=("rms_norm",), run_fn="examples.rms_norm_add_rows", grad_args=(0, 1, 2),
       tile_config_fn="rmsnorm.tile_config"),
    Op("logsumexp", "logprobs", "row-invariant", "logprobs.logsumexp_reference", "examples.logits_inputs", (0,),
       (*_GENERIC, "tests/kernels/test_logsumexp.py"), follows=("token_logprobs",), run_fn="logprobs.logsumexp"),
    Op("logprob_rows", "logprobs", "row-invariant", "logprobs.logprob_rows_reference", "examples.logits_inputs",
       (0,), (*_GENERIC, "tests/kernels/test_logsumexp.py"), follows=("token_logprobs",),
       run_fn="logprobs.logprob_rows"),
    Op("record_add", "record", "exact", "examples.record_add_rows_reference", "examples.record_add_inputs",
       (0, 1, 2, 3, 4, 5, 6, 7), (*_GENERIC, "tests/kernels/test_record_add.py"), run_fn="examples.record_add_rows",
       dtypes=(torch.float32,)),
    Op("quantize_fp8", "quantize_fp8", "exact", "examples.quantize_fp8_rows_reference", "examples.quantize_fp8_inputs",
       (0,), (*_GENERIC, "tests/test_quantize_fp8.py"), run_fn="examples.quantize_fp8_rows",
       dtypes=(torch.bfloat16,)),
)}


def reference_name(op: Op) -> str:
    """The op's own reference function (a row-major form in `examples` wraps it)."""
    if not op.reference_fn.startswith("examples."):
        return op.reference_fn
    return f"{op.file}.{op.name}_reference"


def table() -> str:
    """The registry as the markdown table in `kernels/__init__`'s docstring."""
    rows = ["| op | file | contract | mode | reference | tests |", "|---|---|---|---|---|---|"]
    for op in REGISTRY.values():
        how = "switch" if op.mode_switch else f"follows {', '.join(op.follows)}" if op.follows else \
            "invariant only" if op.unfused_fn else "one path"
        tests = ", ".join(t.removeprefix("tests/") for t in op.tests if t not in _GENERIC) or "generic"
        rows.append(f"| {op.name} | {op.file}.py | {op.contract} | {how} | {reference_name(op)} | {tests} |")
    return "\n".join(rows)

"""Where the kernels run, how they launch, and the input checks every launcher shares.

On a machine without CUDA the Triton kernels run in Triton's interpreter. The
interpreter is chosen when a `@triton.jit` decorator runs, so
`TRITON_INTERPRET=1` is set here, before any kernel module of this package is
imported, and only when the user has not chosen either way.

Three interpreter facts shape the kernels (and the tests):
- bf16 arithmetic on loaded values is wrong there (values are raw bit
  patterns), so every kernel upcasts right after each load;
- `tl.dot` there is numpy's BLAS, whose rounding depends on the CPU kernel it
  picks and on a row's place in the tile, so when interpreting (`DOT_IN_FP32`)
  matmul and attention never call it: `matmul.dot_step` multiplies in fp32 and
  adds in one fixed pairwise tree over k;
- fp32 -> bf16 casts truncate there instead of rounding to nearest even, so
  bf16 outputs differ from a GPU's by at most one ulp.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Only now: `import triton` decorates triton.language's own @jit helpers (tl.sum, ...), for the interpreter or not.
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when the Triton kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


_PDL = contextvars.ContextVar("workbench_pdl", default=False)


@contextlib.contextmanager
def pdl(enabled: bool = True) -> Iterator[None]:
    """Kernels launched inside launch with programmatic dependent launch (PDL), on Hopper and newer.

    The GPU may then start a kernel while the one before it on the stream is still running (once that one's
    programs have all passed `pdl_enter`): its programs are placed on idle SMs and set up during the other's
    tail instead of after it. Each kernel waits in `pdl_enter`, before its first load or store, until the
    kernel before it has finished and its writes are visible, so no value and no bit can change. It pays where
    small kernels of ours follow each other: the generator's decode step. Not elsewhere: a no-grad forward over
    16k tokens measured slower with it, and so did a decode step between cuBLAS and FlashAttention launches
    (which do not launch early) (BENCHMARKS.md, "Numbers behind the code").
    `WORKBENCH_PDL=0` turns it off everywhere (the benchmarks' A/B switch).
    """
    token = _PDL.set(enabled)
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl_flags(t: torch.Tensor) -> dict:
    """A kernel's launch arguments (its `PDL` constexpr and Triton's `launch_pdl`), given a tensor it reads."""
    on = (_PDL.get() and t.device.type == "cuda" and not interpreting()
          and os.environ.get("WORKBENCH_PDL", "1") != "0"
          and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: under PDL, wait for the kernel before it (all its writes visible), then let
    the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs):
    """Ask the L2 cache to fetch the 128-byte lines that hold `ptrs` (a block of global addresses). Nothing is
    read into registers or written: a hint that moves bytes from DRAM into the L2, which is where every SM's
    loads and stores meet, so it can never make a load see an old value. GPU only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


# Rows up to this wide (attention heads, whose q/k norms several kernels compute) are reduced by the pairwise tree
# (a constexpr: the kernels read it; launchers read `.value`).
PAIRWISE_MAX_WIDTH = tl.constexpr(256)


@triton.jit
def _halve(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    a, b = tl.split(tl.reshape(x, (ROWS, WIDTH // 2, 2)))
    return a + b


@triton.jit
def sum_of_squares(x, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """x [ROWS, WIDTH] fp32 (WIDTH a power of 2, padding zeros) -> [ROWS]: each row's sum of squares.

    Rows up to PAIRWISE_MAX_WIDTH: neighbours added pairwise, level by level ((x0^2 + x1^2) + (x2^2 + x3^2)
    ...), each add one fp32 add of two named operands, so the bits are the same in every kernel and under any
    register layout. `tl.sum`'s tree follows the layout the compiler picks for the block, which differs
    between a [16, 128] block of a token's heads and a [128] row: the q/k norm of a training forward, of a
    decode step and of a vLLM step must agree bit for bit. The squares of upcast bf16 values are exact in fp32,
    so a multiply-add the compiler may contract gives the plain add's bits. Wider rows: one `tl.sum`.
    """
    # No early return: Triton compiles the statements after a constexpr branch's `return` too.
    sq = x * x
    if WIDTH > PAIRWISE_MAX_WIDTH:
        out = tl.sum(sq, axis=1)
    else:
        for level in tl.static_range(8):  # the widths 256, 128, ..., 2 that WIDTH reaches, halved in turn
            if WIDTH >= (PAIRWISE_MAX_WIDTH >> level):
                sq = _halve(sq, ROWS, PAIRWISE_MAX_WIDTH >> level)
        out = tl.reshape(sq, (ROWS,))
    return out


# Widths above this take the GPU's block along a vocabulary-sized dimension in the interpreter too.
_INTERPRETER_SMALL_WIDTH = 8192


def width_block(width: int, gpu: int, interpreter: int) -> int:
    """A kernel's block along a vocabulary-sized dimension of this width.

    The GPU's block; in the interpreter, `interpreter` (small) for the tests' small widths, so they
    cross block boundaries, and the GPU's for real vocabularies, whose rows would otherwise take
    thousands of interpreted programs (a real 49k-token model's forward took minutes). A function of
    the width only, never of the number of rows: invariance across batches is untouched.
    """
    if interpreting() and width <= _INTERPRETER_SMALL_WIDTH:
        return interpreter
    return gpu


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: `{name}` has dtype {t.dtype}; the kernels support torch.bfloat16 and "
            f"torch.float32 (cast with .to(torch.bfloat16) or .float())"
        )


def check_same(op: str, tensors: dict[str, torch.Tensor], *, dtype: bool = True) -> None:
    """All tensors on one device (and, by default, of one dtype)."""
    names = list(tensors)
    first = tensors[names[0]]
    for name in names[1:]:
        t = tensors[name]
        if t.device != first.device:
            raise ValueError(
                f"{op}: `{names[0]}` is on {first.device} but `{name}` is on {t.device}; "
                "move them to one device"
            )
        if dtype and t.dtype != first.dtype:
            raise TypeError(
                f"{op}: `{names[0]}` is {first.dtype} but `{name}` is {t.dtype}; "
                "the kernels take one dtype per call"
            )


def check_device(op: str, t: torch.Tensor) -> None:
    """Invariant kernels run on CUDA, or on the CPU only through the interpreter."""
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and interpreting():
        return
    raise RuntimeError(
        f"{op}: the invariant Triton kernels need a CUDA tensor (got one on {t.device}); "
        "on a CPU-only machine set TRITON_INTERPRET=1 before importing workbench, "
        "or use mode('standard')"
    )


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() == 0:
        raise ValueError(f"{op}: `{name}` must have at least one dimension, got a scalar")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{op}: `{name}` must be contiguous in its last dimension (stride 1), got "
            f"strides {tuple(t.stride())}; call .contiguous() on it first"
        )


def rows_view(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [rows, N] without a copy; rows may have any stride."""
    check_last_dim_contiguous(op, name, t)
    n = t.shape[-1]
    if t.dim() == 1:
        return t.view(1, n)
    try:
        return t.view(-1, n)
    except RuntimeError:
        raise ValueError(
            f"{op}: `{name}` with shape {tuple(t.shape)} and strides {tuple(t.stride())} "
            "cannot be seen as rows without a copy; call .contiguous() on it first"
        ) from None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

"""`rms_norm(x, weight, eps)`: the RMSNorm of Llama, Qwen2 and Qwen3, forward and backward.

Numerics contract (mode `invariant`), with Hugging Face's rounding points:
- x is read and upcast to fp32; the sum of squares of a row is `sum_of_squares`
  in fp32: for rows up to 256 wide (attention heads: Qwen3's q/k norms) a fixed
  pairwise tree whose bits no layout changes, the same as `rope_cache_write`'s
  and `norm_rope`'s; for wider rows one `tl.sum` over the whole row (tree order
  fixed by BLOCK_N and num_warps, which depend only on the row width N).
- rstd = 1 / sqrt(sum / N + eps) in fp32.
- Rounding point 1: n = x * rstd is cast to the input dtype (as HF's
  `hidden_states.to(input_dtype)`).
- Rounding point 2: y = weight * n, multiplied in fp32 and cast once (as
  PyTorch's bf16 * bf16).
- Each row's arithmetic is its own (on a GPU one row per program, or for
  head-wide rows a fixed number by the width, as the rows of one block; a fixed
  32 in the interpreter): a row's output never depends on other rows, M, or
  padding.
- Backward, in fp32 with the cast treated as the identity: g = dy * w,
  dx = rstd * (g - n * mean(g * n)) (bit-identical per row, whatever the batch);
  dw = sum over rows of dy * round(n), each program summing a fixed block of
  rows (a tree over each tile of rows, the tiles in order), then the
  programs' partial sums added by one fp32 torch reduction: deterministic run
  to run (dw is a sum over the batch, so it is not batch invariant).
- `rms_norm_add(x, residual, weight)`: the residual add fused in (the decoder's
  stream): h = x + residual added in fp32 and rounded once to the dtype (torch's
  bf16 add), stored, and h's rounded value normalised as above, so (y, h) are
  the bits of (rms_norm(x + residual), x + residual). Backward: the gradient
  reaching h from the layers above is added to the norm's dx in fp32 and the sum
  rounded once (unfused, dx is rounded, then the bf16 add rounds again); x and
  residual get that one gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import (
    PAIRWISE_MAX_WIDTH, check_device, check_float, check_same, interpreting, next_power_of_2, pdl_enter, pdl_flags,
    rows_view, sum_of_squares,
)
from .mode import get_mode

MAX_WIDTH = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, M, N, eps, res_ptr, h_ptr, stride_res, stride_h,
    BLOCK_N: tl.constexpr, ADD_RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    # ROWS rows per program as the rows of one [ROWS, BLOCK_N] block: each row's arithmetic is its own, its sum
    # of squares over its own row (`_forward_rows`).
    pdl_enter(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        h = (x + tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32))
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(sum_of_squares(x, ROWS, BLOCK_N) / N + eps)
    n = (x * rstd[:, None]).to(y_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = n.to(tl.float32) * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr,
    stride_x, stride_dy, stride_dx, M, N, dh_ptr, stride_dh,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, TILE_ROWS: tl.constexpr, ADD_DH: tl.constexpr,
    PDL: tl.constexpr,
):
    # A program owns ROWS consecutive rows, taken TILE_ROWS at a time (loads of
    # several rows in flight); dw is summed over each tile's rows by one tree,
    # then over the tiles in order.
    pdl_enter(PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for i in range(0, ROWS, TILE_ROWS):
        rows = (pid * ROWS + i + tl.arange(0, TILE_ROWS)).to(tl.int64)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        n = x * rstd
        g = dy * w[None, :]
        dx = rstd * (g - n * (tl.sum(g * n, axis=1) / N)[:, None])
        if ADD_DH:
            dx += tl.load(dh_ptr + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * n.to(dx_ptr.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)


# Backward: rows per program and rows per tile (chosen by tools/tune/tune_rowwise.py); head-wide rows (a q/k norm's
# 262k rows of 128 per 16k tokens) take 2,048 elements a tile, so a program is not mostly fixed cost.
_GPU_BACKWARD = {"rows": 8, "tile_rows": 2}
_GPU_BACKWARD_HEADS = {"rows": 64, "tile_rows": 16}
_INTERPRETER_BACKWARD = {"rows": 64, "tile_rows": 16}
# Forward: rows per program. On a GPU one, or 2,048 elements' worth of head-wide rows (one row of 128 per
# program left the q norm's forward at a quarter of the copy speed); in the interpreter, whose cost is per
# program step, 32. A function of the width only, never of M: a row's bits are its own either way.
_INTERPRETER_FORWARD_ROWS = 32
_HEAD_TILE = 2048


def _forward_rows(block_n: int) -> int:
    if interpreting():
        return _INTERPRETER_FORWARD_ROWS
    return _HEAD_TILE // block_n if block_n <= PAIRWISE_MAX_WIDTH.value else 1


def _backward_config(block_n: int) -> dict:
    if interpreting():
        return _INTERPRETER_BACKWARD
    return _GPU_BACKWARD_HEADS if block_n <= PAIRWISE_MAX_WIDTH.value else _GPU_BACKWARD


def _num_warps(block_n: int) -> int:
    return 4 if block_n <= 2048 else 8 if block_n <= 8192 else 16


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return {"block_n": "next power of 2 of the row width", "num_warps": "4 up to 2048, 8 up to 8192, else 16",
            "forward_rows": {"head rows (<= 256)": _forward_rows(128), "wider": _forward_rows(4096)},
            "backward": {"head rows (<= 256)": _backward_config(128), "wider": _backward_config(4096)}}


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_float("rms_norm", "x", x)
    check_float("rms_norm", "weight", weight)
    check_same("rms_norm", {"x": x, "weight": weight})
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of x's last dimension; got x {tuple(x.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if x.shape[-1] > MAX_WIDTH:
        raise ValueError(f"rms_norm: rows wider than {MAX_WIDTH} are not supported (got {x.shape[-1]})")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"rms_norm: eps must be a positive number, got {eps!r}")


def _forward(x, weight, eps, residual):
    """(y, h, rstd) as 2-D row views; h is x itself without a residual."""
    check_device("rms_norm", x)
    x2 = rows_view("rms_norm", "x", x)
    weight = weight.contiguous()  # the kernels read it with unit stride
    m, n = x2.shape
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    rstd = torch.empty((m,), device=x.device, dtype=torch.float32)
    r2 = h = x2
    if residual is not None:
        r2 = rows_view("rms_norm", "residual", residual)
        h = torch.empty((m, n), device=x.device, dtype=x.dtype)
    block_n = next_power_of_2(n)
    rows = _forward_rows(block_n)
    if m > 0:
        _rms_norm_fwd_kernel[(triton.cdiv(m, rows),)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), m, n, float(eps), r2, h, r2.stride(0), h.stride(0),
            BLOCK_N=block_n, ADD_RESIDUAL=residual is not None, ROWS=rows, num_warps=_num_warps(block_n * rows),
            **pdl_flags(x2),
        )
    return y, h, rstd


def _backward(h2, weight, rstd, dy, dh):
    """(dx, dw) of the norm of h2, with the gradient dh reaching h directly added to dx (dh may be None)."""
    m, n = h2.shape
    dy2 = dy.reshape(m, n).contiguous()
    dh2 = dy2 if dh is None else dh.reshape(m, n).contiguous()
    dx = torch.empty_like(h2, memory_format=torch.contiguous_format)
    block_n = next_power_of_2(n)
    bwd = _backward_config(block_n)
    rows = bwd["rows"]
    n_prog = triton.cdiv(m, rows)
    dw_part = torch.empty((max(n_prog, 1), n), device=h2.device, dtype=torch.float32)
    if m == 0:
        dw_part.zero_()
    else:
        _rms_norm_bwd_kernel[(n_prog,)](
            h2, weight, dy2, rstd, dx, dw_part,
            h2.stride(0), dy2.stride(0), dx.stride(0), m, n, dh2, dh2.stride(0),
            BLOCK_N=block_n, ROWS=rows, TILE_ROWS=bwd["tile_rows"], ADD_DH=dh is not None,
            num_warps=_num_warps(block_n * bwd["tile_rows"]), **pdl_flags(h2),
        )
    return dx, dw_part.sum(0).to(weight.dtype)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, x2, rstd = _forward(x, weight, eps, None)
        ctx.save_for_backward(x2, weight.contiguous(), rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(x2, weight, rstd, dy, None)
        return dx.view(dy.shape), dw, None


class RMSNormAddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        y, h, rstd = _forward(x, weight, eps, residual)
        ctx.save_for_backward(h, weight.contiguous(), rstd)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(h, weight, rstd, dy, dh)
        dx = dx.view(dy.shape)
        # x and residual enter h with weight 1: the same gradient (autograd copies before it adds in place).
        return dx, dx, dw, None


def rms_norm_invariant(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    _check(x, weight, eps)
    return RMSNormFn.apply(x, weight, eps)


def rms_norm_standard(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm (= Qwen2RMSNorm = Qwen3RMSNorm), op for op."""
    _check(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one pass over the rows, by the kernel the mode picks for
    `rms_norm` (standard: the add and Hugging Face's norm, op for op)."""
    if x.shape != residual.shape:
        raise ValueError(f"rms_norm_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    if get_mode("rms_norm") == "standard":
        h = x + residual
        return rms_norm_standard(h, weight, eps), h
    _check(x, weight, eps)
    check_float("rms_norm", "residual", residual)
    check_same("rms_norm", {"x": x, "residual": residual})
    return RMSNormAddFn.apply(x, residual, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension, by the kernel the mode picks for `rms_norm`."""
    if get_mode("rms_norm") == "standard":
        return rms_norm_standard(x, weight, eps)
    return rms_norm_invariant(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp64 reference, no intermediate rounding."""
    h = x.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_add_reference(x, residual, weight, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 reference: (RMSNorm(x + residual), x + residual), the sum not rounded."""
    h = x.double() + residual.double()
    return rms_norm_reference(h, weight, eps), h

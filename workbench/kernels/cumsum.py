"""`row_cumsum(x)`: inclusive prefix sums along the last dimension, in fp32, in one fixed order.

Numerics contract: one program per row; the row is taken in blocks of BLOCK
columns in increasing order; within a block `tl.cumsum` (a tree fixed by BLOCK
and num_warps), plus the running total of the blocks before it. So a row's
sums are the same bits whatever the number of rows: unlike a library scan,
which may switch algorithms with the shape (a single row, say). Used by top-p
sampling, whose kept set must not depend on the batch. Forward only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_device, pdl_enter, pdl_flags, rows_view, width_block


@triton.jit
def _row_cumsum_kernel(x_ptr, y_ptr, stride_x, stride_y, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    carry = tl.zeros((), tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = tl.cumsum(x, axis=0) + carry
        tl.store(y_ptr + row * stride_y + cols, y, mask=cols < N)
        carry += tl.sum(x, axis=0)


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """fp32 inclusive prefix sums of x[..., N] along the last dimension, batch invariant."""
    check_device("row_cumsum", x)
    x2 = rows_view("row_cumsum", "x", x)
    y = torch.empty(x2.shape, device=x.device, dtype=torch.float32)
    if x2.numel():
        _row_cumsum_kernel[(x2.shape[0],)](x2, y, x2.stride(0), y.stride(0), x2.shape[1],
                                           BLOCK=width_block(x2.shape[1], 2048, 256), num_warps=4,
                                           **pdl_flags(x2))
    return y.view(x.shape)


def row_cumsum_reference(x: torch.Tensor) -> torch.Tensor:
    """fp64 reference."""
    return torch.cumsum(x.double(), dim=-1)

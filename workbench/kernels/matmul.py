"""`linear(x, weight)` = x @ weight.T, forward and backward.

Numerics contract (mode `invariant`):
- Operands are read in their dtype (bf16 or fp32) and multiplied on the
  tensor cores (bf16) or in IEEE fp32 (`input_precision="ieee"`, never tf32).
- Each output element is accumulated in one fp32 register, over K in blocks of
  BLOCK_K taken in increasing order: acc = dot(a_0, b_0); acc = dot(a_1, b_1, acc); ...
  No split-K, no atomics, no run-time autotuning.
- One rounding point: the fp32 accumulator is cast to the output dtype once.
- BLOCK_K, and so the order of every sum, depends only on (K, dtype, GPU),
  never on M. The M-side tiles may change with M (see `MATMUL_BUCKETS`); each
  bucket is checked bitwise against the others on the GPU
  (`tests/test_gpu.py`), since a row's result must not depend on its bucket.
  So a row of x gives the same bits alone, in any batch, at any position, next
  to any other rows, with or without padding rows.
- Backward: dx = dy @ W is computed by the same kernel (so it is batch
  invariant too); dW = dy.T @ x reduces over the token dimension in blocks of
  BLOCK_K in order, so it is deterministic run to run. Gradients come out in
  the dtype of the tensor they belong to.

In the interpreter (CPU) the dot operands are upcast to fp32 (`DOT_IN_FP32`),
so bf16 products are exact and the final cast truncates: compare bf16 results
with a tolerance there, bitwise only with themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import check_device, check_float, check_same, interpreting
from .mode import get_mode


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr,
):
    # C[M, N] = A[M, K] @ B[K, N] for any strides.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped launch order, for L2 reuse of B tiles; it changes which program
    # computes a tile, never how a tile is computed.
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % width) % group_rows)
    pid_n = (pid % width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns wrap onto valid memory instead of being masked:
    # they feed only output elements that are never stored.
    rows = offs_m % M
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            # The K tail is zero-filled on both sides: zero products leave the sum unchanged.
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c = acc.to(c_ptr.dtype.element_ty)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, c, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


# Interpreter: small tiles keep a CPU test in the tens of milliseconds.
_INTERPRETER = MatmulConfig(32, 32, 32, group_m=4, num_warps=4, num_stages=1)

# GPU, bf16: (largest M of the bucket, config), chosen by `bench/tune_matmul.py`
# on an H200. BLOCK_K is 64 in every bucket; with it every candidate config gave
# the same bits on every row, which is what lets the M-side tiles follow M.
MATMUL_BUCKETS: tuple[tuple[int, MatmulConfig], ...] = (
    (16, MatmulConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=4)),
    (128, MatmulConfig(64, 32, 64, group_m=8, num_warps=4, num_stages=4)),
    (512, MatmulConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=4)),
    (1 << 62, MatmulConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3)),
)
# GPU, fp32 (IEEE dot, FMA units): one config for every M.
_FP32 = MatmulConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2)


def matmul_config(m: int, dtype: torch.dtype) -> MatmulConfig:
    """The tile config for a product with `m` rows. Only the M-side tiles may depend on m."""
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    for max_m, cfg in MATMUL_BUCKETS:
        if m <= max_m:
            return cfg
    raise AssertionError("unreachable: the last bucket is unbounded")


def tile_config() -> dict:
    """The tile configs in force here (for the environment record)."""
    if interpreting():
        return {"interpreter": vars(_INTERPRETER)}
    return {"bf16_buckets": [(m, vars(c)) for m, c in MATMUL_BUCKETS], "fp32": vars(_FP32)}


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a[M, K] @ b[K, N] with the invariant kernel; any strides."""
    m, k = a.shape
    k2, n = b.shape
    assert k == k2, (a.shape, b.shape)
    c = torch.empty((m, n), device=a.device, dtype=out_dtype or a.dtype)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    cfg = matmul_config(m, a.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _matmul_kernel[grid](
        a, b, c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=(k % cfg.block_k == 0),
        DOT_IN_FP32=interpreting(), IEEE=(a.dtype == torch.float32 or interpreting()),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def _check_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("linear", "x", x)
    check_float("linear", "weight", weight)
    check_same("linear", {"x": x, "weight": weight})
    if weight.dim() != 2:
        raise ValueError(f"linear: `weight` must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x's last dimension must equal weight's K = {weight.shape[1]}; "
            f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check_device("linear", x)
        x2 = x.reshape(-1, x.shape[-1])
        y = matmul(x2, weight.t())
        ctx.save_for_backward(x2, weight)
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = matmul(dy2, weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = matmul(dy2.t(), x2, out_dtype=weight.dtype)
        return dx, dw


def linear_invariant(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check_linear(x, weight)
    return LinearFn.apply(x, weight)


def linear_standard(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cuBLAS (or the CPU BLAS): tiling and split-K chosen per shape, so rows depend on M."""
    _check_linear(x, weight)
    return F.linear(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x[..., K] @ weight[N, K].T -> [..., N], by the kernel the mode picks for `linear`."""
    if get_mode("linear") == "standard":
        return linear_standard(x, weight)
    return linear_invariant(x, weight)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp64 reference."""
    return x.double() @ weight.double().t()

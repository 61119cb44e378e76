"""`rms_norm_linear(x, residual, norm_weight, weight, eps)` = (linear(rms_norm(h), weight), h), h = x + residual: the
decoder's residual add and RMSNorm in the prologue of the product that reads the normalised rows, in one launch,
for forwards without autograd at decode sizes (generation).

Unfused, a decode step runs `rms_norm_add` (one launch a norm, two a layer), then the q/k/v or gate/up product
reads back the rows it just wrote. Here each program of the product first normalises its own row tile, then
multiplies: the norm is recomputed by every column tile of the product (a decode step's rows are few;
`prologue_pays` says where reading them again should cost less than the launch), and the stream h is stored by
the first column tile's programs.

Numerics contract (modes `invariant` for `rms_norm` and `linear`; `DecodingModel` calls this only then): the bits
of `rms_norm_add(x, residual, norm_weight, eps)` (`rms_norm` without a residual) followed by `linear(., weight)`:
- each row's rstd is `rms_norm`'s forward kernel's (`rmsnorm.row_rstd`, the same statements): the row whole,
  h = x + residual added in fp32 and rounded once, the sum of squares of its width in one `tl.sum` over a
  block of the same width (next power of 2) and the same warps, a row's share of lanes and warps the same as
  that kernel's one row a program (below); rstd = 1 / sqrt(sum / N + eps) in fp32;
- the normalised row is `rmsnorm.normalise`'s: x * rstd rounded to the dtype, times the weight in fp32, rounded;
  elementwise, so the product's k-tiles see the same bf16 values the norm kernel stores;
- the product is `linear`'s chain of k-steps for each output column (`dot_step`, K blocks in increasing order,
  the tail zero-filled), rounded to the dtype once.
Several rows at a time: on a GPU `tl.sum`'s tree follows the block's register layout, and a row's share of it
is the one kernel's only where each row spans every lane of every warp in 8-element (16-byte) pieces, as it
does in a [1, W] block: W >= 256 x warps (`fused_config` refuses narrower rows, and launches with the norm's
warps). On Hopper a product's bits do not depend on its tiles (`matmul.py`), so the product part takes tiles
of its own (16 rows up to 64 rows, `_SMALL_TILE`; above, the product's `matmul_config`); other GPUs run the
unfused ops (None). The interpreter runs
`matmul_config`'s tiles too, and the norm's rows in one block of `BLOCK_M` rows (the norm kernel's 32), whose
`np.sum` sums each row alone. The GPU test (`tests/test_gpu_model.py`) holds it to the unfused ops bit for bit.

Inference only: no `autograd.Function` (a training forward runs the norm and the product, which have their
backward). No bias (Qwen2's q/k/v runs the unfused ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting, l2_prefetch, next_power_of_2, pdl_enter, pdl_flags
from .matmul import _descriptor, _prefetch_k, _tile_origin, dot_step
from .matmul_tiles import _DECODE_MIN_WEIGHTS, MatmulConfig, _device_capability, _uses_buckets, matmul_config
from .rmsnorm import _INTERPRETER_FORWARD_ROWS, _num_warps, normalise, row_rstd

# Decode sizes only: larger batches run the norm, then the product's persistent tiles.
MAX_ROWS = 256
# fp32 elements a thread holds of each norm block (NORM_ROWS rows of the width's block): a few rows at a time.
_NORM_ELEMENTS = 64
# Every column tile's program normalises its row tile again: 4 bytes (x and residual) an element of M x K, N / BLOCK_N
# times, 2 M / BLOCK_N times the weights' bytes, from the L2. Small row tiles keep that and the norm's serial
# latency a program's short where a product is latency-bound (up to 64 rows, the M <= 32 bucket's tile, 16 rows);
# above, the product's own tiles. Not yet measured (`bench/profile_decode.py` shows the step; `prologue_pays`).
_SMALL_ROWS = 64
_SMALL_TILE = MatmulConfig(16, 64, 256, group_m=8, num_warps=4, num_stages=4)


@triton.jit
def norm_rows_rstd(x_ptr, res_ptr, h_ptr, off_m, M, K, eps, stride_x, stride_res, stride_h, store_h,
                   BLOCK_M: tl.constexpr, BLOCK_NORM: tl.constexpr, NORM_ROWS: tl.constexpr,
                   ADD_RESIDUAL: tl.constexpr):
    """[BLOCK_M] rstd of rows off_m.. (`rms_norm_add`'s kernel's arithmetic, NORM_ROWS whole rows at a time),
    storing the stream h = x + residual of those rows where store_h."""
    cols = tl.arange(0, BLOCK_NORM)
    slots = tl.arange(0, BLOCK_M)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c in tl.static_range(0, BLOCK_M, NORM_ROWS):
        rows = (off_m + c + tl.arange(0, NORM_ROWS)).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ADD_RESIDUAL:
            h = x + tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], h, mask=mask & store_h)
            x = h.to(tl.float32)
        r = row_rstd(x, K, eps, NORM_ROWS, BLOCK_NORM)
        # Into slots c..: each slot's sum is its one value plus zeros, exact.
        hit = slots[:, None] == (c + tl.arange(0, NORM_ROWS))[None, :]
        rstd += tl.sum(tl.where(hit, r[None, :], 0.0), axis=1)
    return rstd


@triton.jit
def normalised_tile(x_ptr, res_ptr, w_ptr, rstd, offs_m, off_k, M, K, stride_x, stride_res,
                    BLOCK_K: tl.constexpr, ADD_RESIDUAL: tl.constexpr, dtype: tl.constexpr):
    """The normalised rows' [BLOCK_M, BLOCK_K] tile at column off_k, zeros past M and K (the product's tail)."""
    ks = off_k + tl.arange(0, BLOCK_K)
    mask = (offs_m < M)[:, None] & (ks < K)[None, :]
    rows = offs_m.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        x = x + tl.load(res_ptr + rows[:, None] * stride_res + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype).to(tl.float32)
    w = tl.load(w_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return normalise(x, rstd, w, dtype)


@triton.jit
def _norm_linear_kernel(
    x_ptr, res_ptr, h_ptr, nw_ptr, b_desc, c_desc, M, N, K, eps, stride_x, stride_res, stride_h, b_ptr, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_NORM: tl.constexpr, NORM_ROWS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PREFETCH_K: tl.constexpr, PDL: tl.constexpr,
):
    # b_desc: the weight [N, K]; c_desc: the output [M, N].
    off_m, off_n = _tile_origin(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), BLOCK_M, BLOCK_N, GROUP_M)
    if PREFETCH_K > 0:
        # As `_matmul_tma_kernel`: the weights are no output of the kernel before, so they may start moving to the
        # L2 before the PDL wait.
        rows = ((off_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        l2_prefetch(b_ptr + rows[:, None] * stride_bn + tl.arange(0, PREFETCH_K // 64)[None, :] * 64)
    pdl_enter(PDL)
    rstd = norm_rows_rstd(x_ptr, res_ptr, h_ptr, off_m, M, K, eps, stride_x, stride_res, stride_h, off_n == 0,
                          BLOCK_M, BLOCK_NORM, NORM_ROWS, ADD_RESIDUAL)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = normalised_tile(x_ptr, res_ptr, nw_ptr, rstd, offs_m, k * BLOCK_K, M, K, stride_x, stride_res,
                            BLOCK_K, ADD_RESIDUAL, c_desc.dtype)
        acc = dot_step(a, tl.trans(b_desc.load([off_n, k * BLOCK_K])), acc, DOT_IN_FP32, DOT_IN_FP32)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def fused_config(m: int, k: int, device: torch.device, n: int = 0) -> MatmulConfig | None:
    """The product's tiles for `m` rows of width `k` here (launched with the norm's warps), or None where the
    fused kernel does not run: more than MAX_ROWS rows, a GPU whose product does not let tiles follow M (not
    Hopper), or rows too narrow to span the warps as the norm kernel's one row does (the contract)."""
    if interpreting():
        return matmul_config(m, torch.bfloat16, device, n, k)
    if m > MAX_ROWS or device.type != "cuda" or not _uses_buckets(_device_capability(device)):
        return None
    return with_norm_warps(_SMALL_TILE if m <= _SMALL_ROWS else matmul_config(m, torch.bfloat16, device, n, k), k)


def prologue_pays(n: int, k: int) -> bool:
    """Whether a decode product of an [n, k] weight should take the norm in its prologue (`DecodingModel`, once):
    where it is latency-bound, fewer weights than the decode tiles' floor `_DECODE_MIN_WEIGHTS` (SmolLM2-135M's
    products), the norm's launch costs more than reading its rows again; where reading the weights is the cost
    (Qwen3-1.7B's), the norm's rows read again by each column tile (2 M / BLOCK_N times the weights' bytes, above)
    would likely cost more than the launch. A rule to check against `bench/profile_decode.py` on the GPU."""
    return n * k < _DECODE_MIN_WEIGHTS


def with_norm_warps(cfg: MatmulConfig, k: int) -> MatmulConfig | None:
    """A product's GPU tiles launched with the warps of the norm kernel for rows of width k, or None where such a
    row does not span every lane of every warp in 8-element pieces (the contract: then its sum's tree differs)."""
    block_norm = next_power_of_2(k)
    warps = _num_warps(block_norm)
    if block_norm < 256 * warps:
        return None
    return MatmulConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, warps, cfg.num_stages)


def _norm_rows(block_m: int, block_norm: int, warps: int) -> int:
    """Rows a norm block: the norm kernel's in the interpreter (a block of BLOCK_M), a few on a GPU (registers)."""
    if interpreting():
        return min(block_m, _INTERPRETER_FORWARD_ROWS)
    return max(1, min(block_m, _NORM_ELEMENTS * 32 * warps // block_norm))


def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rms_norm(h) @ weight.T [..., N], h [..., K]) with h = x + residual (x itself when residual is None), for x
    [..., K] and weight [N, K], bf16, in one launch; None where the fused kernel does not apply (see `fused_config`;
    operands TMA cannot read; rows not of unit stride), for the caller to run the unfused ops."""
    k = x.shape[-1]
    tensors = (x, norm_weight, weight) if residual is None else (x, residual, norm_weight, weight)
    if any(t.dtype != torch.bfloat16 or t.device != x.device for t in tensors) or weight.dim() != 2 or \
            weight.shape[1] != k or norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        return None
    x2 = x.reshape(-1, k)
    r2 = x2 if residual is None else residual.reshape(-1, k)
    m, n = x2.shape[0], weight.shape[0]
    cfg = fused_config(m, k, x.device, n)
    if cfg is None or m == 0 or k == 0 or x2.stride(1) != 1 or r2.stride(1) != 1:
        return None
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    h = x2 if residual is None else torch.empty((m, k), device=x.device, dtype=x.dtype)
    b_desc, c_desc = _descriptor(weight, [bn, bk]), _descriptor(out, [bm, bn])
    if b_desc is None or c_desc is None:
        return None
    block_norm = next_power_of_2(k)
    flags = pdl_flags(x2)
    _norm_linear_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        x2, r2, h, norm_weight.contiguous(), b_desc, c_desc, m, n, k, float(eps),
        x2.stride(0), r2.stride(0), h.stride(0), weight, weight.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, BLOCK_NORM=block_norm,
        NORM_ROWS=_norm_rows(bm, block_norm, cfg.num_warps), ADD_RESIDUAL=residual is not None,
        DOT_IN_FP32=interpreting(), PREFETCH_K=_prefetch_k(m, k, weight.t(), True, flags["PDL"]), **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.view(*x.shape[:-1], n), h.view(x.shape)


def tile_config() -> dict:
    """The rule in force (for the environment record)."""
    return {"tiles": "the product's (matmul_config), with the norm's warps", "max_rows": MAX_ROWS,
            "norm_block": "next power of 2 of the width, at least 256 x warps on a GPU",
            "norm_rows": "the interpreter's norm rows (32)" if interpreting() else
            f"{_NORM_ELEMENTS} fp32 elements a thread"}


def rms_norm_linear_reference(x, residual, norm_weight, weight, eps: float = 1e-6):
    """fp64 reference: (RMSNorm(h) @ weight.T, h), h = x + residual, nothing rounded."""
    h = x.double() if residual is None else x.double() + residual.double()
    y = norm_weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return y @ weight.double().t(), h

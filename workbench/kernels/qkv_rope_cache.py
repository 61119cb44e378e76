"""`rms_norm_qkv_rope_cache(x, residual, norm_weight, weight, hq, hkv, cos, sin, cache_k, cache_v, start, ...)`: a
decode step's attention inputs in one launch: the residual add and RMSNorm in the prologue of the packed q/k/v
product (`rms_norm_linear`'s), and in its epilogue q/k's optional per-head RMSNorm (Qwen3), RoPE, and the K/V write
into the static cache (`rope_cache_write`'s); returns the rotated q and the stream.

Unfused, a decode layer's attention inputs take two launches here: `rms_norm_linear` writes the q/k/v product, then
`rope_cache_write` reads it back, rotates it and writes the cache (one node a layer of ~1.6 us in a CUDA graph at
the SmolLM2-135M shape). Here a program's output tile is one head's columns (BLOCK_N = head_dim): the rotation
pairs column d with d + D/2 of the same head and the q/k norm reads the head's whole row, so the tile holds every
value its epilogue needs; which head it is (q, k or v: the packed weight's rows are q's heads, then k's, then v's)
says where its columns go.

Numerics contract (modes `invariant` for `rms_norm`, `linear` and `apply_rope`; `DecodingModel` calls this only
then): the bits of `rms_norm_linear(x, residual, norm_weight, weight)` (so of `rms_norm_add` then `linear`), its
output split into q, k and v heads, then `rope_cache_write`:
- the prologue and the product are `rms_norm_linear`'s (`norm_rows_rstd`, `normalised_tile`, `dot_step` over K in
  increasing blocks), with its row tiles, warps and BLOCK_K (`norm_linear.fused_config`); only BLOCK_N differs, the
  head dim. The N tile moves no bit: on Hopper a product's chain of k-steps does not depend on its M or N tiles
  (`matmul.py`'s contract: its tables' BLOCK_N of 16 to 256 give the same bits, tests/test_gpu.py), and in the
  interpreter `dot_step` sums each output element's own products (elementwise over N), with the same BLOCK_K;
- the fp32 accumulator is rounded to bf16 once, as `linear` stores it; the epilogue reads those bf16 values, never
  the fp32 accumulator: v is that value; q and k are `rope_cache_write`'s arithmetic on it (`qk_norm_halves`,
  then `rotate`: the same statements), cast once to the output's dtype;
- every output depends only on its own token and head.
The GPU test (`tests/test_gpu_model.py`) holds it to the unfused ops bit for bit, the CPU tests in the
interpreter (`tests/test_qkv_rope_cache.py`).

Inference only (no `autograd.Function`): a training forward runs the unfused ops. No bias (Qwen2's q/k/v runs the
unfused ops), bf16 only, head dims a power of 2 from 16 to 256 (`sum_of_squares`'s tree), at decode sizes
(`norm_linear.fused_config`); elsewhere the launcher returns None and the caller runs the two kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting, l2_prefetch, next_power_of_2, pdl_enter, pdl_flags
from .matmul import _descriptor, _prefetch_k, _tile_origin, dot_step
from .matmul_tiles import MatmulConfig
from .norm_linear import _norm_rows, fused_config, norm_rows_rstd, normalised_tile, rms_norm_linear_reference
from .rope import rotate
from .rope_cache import _check, qk_norm_halves, rope_cache_write_reference

# Shared memory for the weight tiles in flight: a tile of 128 columns (a head of 128) by the small tile's BLOCK_K of
# 256 is 64 KiB, so the 4 stages of `rms_norm_linear`'s 64 columns would not fit in Hopper's 227 KiB; fewer
# stages, the same chain of k-steps (pipelining moves when bytes arrive, never a value).
_STAGE_BYTES = 128 * 1024


@triton.jit
def _qkv_rope_cache_kernel(
    x_ptr, res_ptr, h_ptr, nw_ptr, b_desc, q_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, ck_ptr, cv_ptr, start_ptr,
    M, K, T, HQ, HKV, eps, qk_eps, stride_x, stride_res, stride_h, b_ptr, stride_bn,
    scache_b, scache_s, scache_h,
    BLOCK_M: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_NORM: tl.constexpr, NORM_ROWS: tl.constexpr, ADD_RESIDUAL: tl.constexpr, QK_NORM: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PREFETCH_K: tl.constexpr, PDL: tl.constexpr,
):
    # b_desc: the packed weight [(HQ + 2 HKV) D, K]; q_ptr: the rotated q [M, HQ D]; a program: a row tile x a head.
    heads = HQ + 2 * HKV
    off_m, off_n = _tile_origin(tl.program_id(0), tl.cdiv(M, BLOCK_M), heads, BLOCK_M, D, GROUP_M)
    if PREFETCH_K > 0:
        # As `_norm_linear_kernel`: the weights are no output of the kernel before.
        wrows = (off_n + tl.arange(0, D)).to(tl.int64)
        l2_prefetch(b_ptr + wrows[:, None] * stride_bn + tl.arange(0, PREFETCH_K // 64)[None, :] * 64)
    pdl_enter(PDL)
    rstd = norm_rows_rstd(x_ptr, res_ptr, h_ptr, off_m, M, K, eps, stride_x, stride_res, stride_h, off_n == 0,
                          BLOCK_M, BLOCK_NORM, NORM_ROWS, ADD_RESIDUAL)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = normalised_tile(x_ptr, res_ptr, nw_ptr, rstd, offs_m, k * BLOCK_K, M, K, stride_x, stride_res,
                            BLOCK_K, ADD_RESIDUAL, q_ptr.dtype.element_ty)
        acc = dot_step(a, tl.trans(b_desc.load([off_n, k * BLOCK_K])), acc, DOT_IN_FP32, DOT_IN_FP32)
    # The product's one rounding, as `linear` stores it: the epilogue works on these values only.
    y = acc.to(q_ptr.dtype.element_ty)
    rows = offs_m.to(tl.int64)
    live = (rows < M)[:, None]
    b = rows // T
    pos = tl.load(start_ptr + b, mask=rows < M, other=0).to(tl.int64) + rows % T
    cache_row = (b * scache_b + pos * scache_s)[:, None]
    head = off_n // D
    if head >= HQ + HKV:
        # v: the product's bits into the cache.
        cols = tl.arange(0, D)[None, :]
        tl.store(cv_ptr + cache_row + (head - HQ - HKV) * scache_h + cols, y, mask=live)
    else:
        d = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + rows[:, None] * HALF + d, mask=live, other=0.0)
        s = tl.load(sin_ptr + rows[:, None] * HALF + d, mask=live, other=0.0)
        # The head's halves: columns d and D/2 + d.
        y1, y2 = tl.split(tl.permute(tl.reshape(y, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        if head < HQ:
            if QK_NORM:
                y1, y2 = qk_norm_halves(y1, y2, y.to(tl.float32), qn_ptr, qk_eps, D, HALF, BLOCK_M, D, HALF)
            dst = q_ptr + rows[:, None] * (HQ * D) + head * D + d
        else:
            if QK_NORM:
                y1, y2 = qk_norm_halves(y1, y2, y.to(tl.float32), kn_ptr, qk_eps, D, HALF, BLOCK_M, D, HALF)
            dst = ck_ptr + cache_row + (head - HQ) * scache_h + d
        r1, r2 = rotate(y1.to(tl.float32), y2.to(tl.float32), c, s)
        tl.store(dst, r1.to(dst.dtype.element_ty), mask=live)
        tl.store(dst + HALF, r2.to(dst.dtype.element_ty), mask=live)


def rms_norm_qkv_rope_cache(x, residual, norm_weight, weight, hq: int, hkv: int, cos, sin, cache_k, cache_v, start,
                            q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6, qk_eps: float = 1e-6):
    """(q [B, T, hq, D] rotated, h [B, T, K]) with h = x + residual (x itself when residual is None): the q/k/v
    product of rms_norm(h) (eps) by the packed weight [(hq + 2 hkv) D, K], its k (rotated) and v written into
    cache_k, cache_v [B, S, hkv, D] at positions start[b] + t, q and k RMS-normalised per head first with
    q_norm_weight and k_norm_weight (qk_eps). None where the fused kernel does not apply (see the module
    docstring), for the caller to run `rms_norm_linear` then `rope_cache_write`."""
    if x.dim() != 3 or cache_k.dim() != 4:
        return None
    bsz, t, k = x.shape
    d = cache_k.shape[-1]
    tensors = [x, norm_weight, weight, cache_k, cache_v] + ([] if residual is None else [residual])
    if any(u.dtype != torch.bfloat16 or u.device != x.device for u in tensors) or weight.dim() != 2 or \
            weight.shape != ((hq + 2 * hkv) * d, k) or norm_weight.shape != (k,) or \
            (residual is not None and residual.shape != x.shape) or d < 16 or d > 256 or d & (d - 1):
        return None
    q_shape, kv_shape = (bsz, t, hq, d), (bsz, t, hkv, d)
    # The argument checks of `rope_cache_write` (shapes of the tables, the cache, start and the norm weights).
    _check(torch.empty(q_shape, device="meta", dtype=x.dtype),
           *(torch.empty(kv_shape, device="meta", dtype=x.dtype) for _ in range(2)), cos, sin, cache_k, cache_v,
           start, q_norm_weight, k_norm_weight)
    x2 = x.reshape(-1, k)
    r2 = x2 if residual is None else residual.reshape(-1, k)
    m = x2.shape[0]
    cfg = fused_config(m, k, x.device, weight.shape[0])
    if cfg is None or m == 0 or k == 0 or x2.stride(1) != 1 or r2.stride(1) != 1:
        return None
    stages = min(cfg.num_stages, max(2, _STAGE_BYTES // (2 * d * cfg.block_k)))
    cfg = MatmulConfig(cfg.block_m, d, cfg.block_k, cfg.group_m, cfg.num_warps, stages)
    b_desc = _descriptor(weight, [d, cfg.block_k])
    if b_desc is None:
        return None
    q = torch.empty(q_shape, device=x.device, dtype=x.dtype)
    h = x2 if residual is None else torch.empty((m, k), device=x.device, dtype=x.dtype)
    qk_norm = q_norm_weight is not None
    qn, kn = (q_norm_weight.contiguous(), k_norm_weight.contiguous()) if qk_norm else (norm_weight, norm_weight)
    block_norm = next_power_of_2(k)
    flags = pdl_flags(x2)
    _qkv_rope_cache_kernel[(triton.cdiv(m, cfg.block_m) * (hq + 2 * hkv),)](
        x2, r2, h, norm_weight.contiguous(), b_desc, q, cos.contiguous(), sin.contiguous(), qn, kn, cache_k, cache_v,
        start, m, k, t, hq, hkv, float(eps), float(qk_eps), x2.stride(0), r2.stride(0), h.stride(0),
        weight, weight.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
        BLOCK_M=cfg.block_m, D=d, HALF=d // 2, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, BLOCK_NORM=block_norm,
        NORM_ROWS=_norm_rows(cfg.block_m, block_norm, cfg.num_warps), ADD_RESIDUAL=residual is not None,
        QK_NORM=qk_norm, DOT_IN_FP32=interpreting(), **flags,
        PREFETCH_K=_prefetch_k(m, k, weight.t(), True, flags["PDL"]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return q, h.view(x.shape)


def tile_config() -> dict:
    """The rule in force (for the environment record)."""
    return {"tiles": "norm_linear.fused_config's rows, warps and BLOCK_K; BLOCK_N the head dim (one head a tile)",
            "weight_stage_bytes": _STAGE_BYTES}


def rms_norm_qkv_rope_cache_reference(x, residual, norm_weight, weight, hq, hkv, cos, sin, cache_k, cache_v, start,
                                      q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6,
                                      qk_eps: float = 1e-6):
    """fp64 reference: (q rotated, h), nothing rounded; k (rounded to the cache's dtype) and v written into the
    cache."""
    bsz, t, _ = x.shape
    d = cache_k.shape[-1]
    y, h = rms_norm_linear_reference(x, residual, norm_weight, weight, eps)
    q, k, v = y.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rope_cache_write_reference(q.reshape(bsz, t, hq, d), k.reshape(bsz, t, hkv, d), v.reshape(bsz, t, hkv, d),
                                   cos, sin, cache_k, cache_v, start, q_norm_weight, k_norm_weight, qk_eps)
    return q, h

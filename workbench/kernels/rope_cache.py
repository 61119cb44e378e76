"""`rope_cache_write(q, k, v, cos, sin, cache_k, cache_v, start, ...)`: a generation step's attention inputs in one
launch: the optional per-head q/k RMSNorm (Qwen3), RoPE on q and k, and k and v written into the static KV cache.

Unfused, a decode step runs these as some ten kernels a layer (two copies, two norms, two rotations, the
position arithmetic and two scatters), each a few microseconds of mostly fixed cost against a step's ~30 us of
weight reads per layer; in a CUDA graph each is also a node. Fused, the step has one node here per layer: a
token's q heads are one program's block, its k and v heads another's, so a program's loads go out together (one
program per head made each a short chain of dependent loads, and at batch 256 several waves of them).

Numerics contract (mode `invariant`): the same bits as the unfused ops in sequence, `rms_norm`, then
`apply_rope`, then the cache write:
- the norm's sum of squares is `sum_of_squares` over the whole head row in fp32, as in `rms_norm`'s kernel
  (for heads up to 256 wide a fixed pairwise tree, the same bits under any layout); rstd, the rounding of
  x * rstd to the dtype and of weight * n are `rms_norm`'s, written the same way;
- the rotation is `apply_rope`'s (`rotate`: one explicit FMA an output): the rounded halves upcast to fp32,
  x1 * cos - x2 * sin and x2 * cos + x1 * sin in fp32 against the fp32 tables, cast once;
- v is copied bit for bit;
- every output depends only on its own token and head: no dependence on the batch, the other tokens or padding.
The GPU tests hold it to the unfused ops bit for bit (`tests/test_gpu_model.py`), the CPU tests in the
interpreter (`tests/test_rope_cache.py`).

Inference only (generation and scoring forwards run without autograd), so no `autograd.Function`: a training
forward runs the unfused ops, which have their backward. The `standard` mode keeps Hugging Face's unfused ops
(`apply_rope_standard`), so this kernel serves `invariant` mode alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_device, next_power_of_2, pdl_enter, pdl_flags, sum_of_squares
from .rope import apply_rope_reference, rotate


@triton.jit
def _norm_rotate_heads(src, sh, w_ptr, c, s, eps, H, D, HALF,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    # A token's H head rows (stride sh) as one [BLOCK_H, .] block: the optional norm, then the rotation (fp32 halves).
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    half = (h < H) & (d < HALF)  # the returned [BLOCK_H, BLOCK_HALF] halves are valid here
    x1 = tl.load(src + h * sh + d, mask=half, other=0.0)
    x2 = tl.load(src + h * sh + HALF + d, mask=half, other=0.0)
    if NORM:
        # rms_norm's row: `sum_of_squares` over each full head row (its tree under any layout), each half rounded
        # as it does.
        full = tl.arange(0, BLOCK_D)[None, :]
        x = tl.load(src + h * sh + full, mask=(h < H) & (full < D), other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(sum_of_squares(x, BLOCK_H, BLOCK_D) / D + eps))[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        n1 = (x1.to(tl.float32) * rstd).to(x1.dtype)
        n2 = (x2.to(tl.float32) * rstd).to(x2.dtype)
        x1 = (n1.to(tl.float32) * w1).to(x1.dtype)
        x2 = (n2.to(tl.float32) * w2).to(x2.dtype)
    return rotate(x1.to(tl.float32), x2.to(tl.float32), c, s)


@triton.jit
def _rope_cache_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, out_ptr, ck_ptr, cv_ptr, start_ptr,
    T, HQ, HKV, D, HALF, eps,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t,
    so_b, so_t, so_h, scache_b, scache_s, scache_h,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, PDL: tl.constexpr,
):
    # Program (token, 0) takes the token's q heads, (token, 1) its k and v heads.
    pdl_enter(PDL)
    m = tl.program_id(0).to(tl.int64)       # token: b * T + t
    b = m // T
    t = m % T
    d = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + b * sc_b + t * sc_t + d, mask=d < HALF, other=0.0)
    s = tl.load(sin_ptr + b * sc_b + t * sc_t + d, mask=d < HALF, other=0.0)
    # The two branches name their blocks apart: Triton types every name across an if's branches, and the q and
    # kv blocks differ in shape.
    if tl.program_id(1) == 0:
        hq = tl.arange(0, BLOCK_HQ)[:, None]
        q1, q2 = _norm_rotate_heads(q_ptr + b * sq_b + t * sq_t, sq_h, qn_ptr, c, s, eps, HQ, D, HALF,
                                    BLOCK_HQ, BLOCK_D, BLOCK_HALF, NORM)
        q_dst = out_ptr + b * so_b + t * so_t + hq * so_h + d
        tl.store(q_dst, q1.to(q_dst.dtype.element_ty), mask=(hq < HQ) & (d < HALF))
        tl.store(q_dst + HALF, q2.to(q_dst.dtype.element_ty), mask=(hq < HQ) & (d < HALF))
    else:
        pos = tl.load(start_ptr + b).to(tl.int64) + t
        cache_row = b * scache_b + pos * scache_s
        hk = tl.arange(0, BLOCK_HKV)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]
        vrow = tl.load(v_ptr + b * sv_b + t * sv_t + hk * sv_h + cols, mask=(hk < HKV) & (cols < D))
        tl.store(cv_ptr + cache_row + hk * scache_h + cols, vrow, mask=(hk < HKV) & (cols < D))
        k1, k2 = _norm_rotate_heads(k_ptr + b * sk_b + t * sk_t, sk_h, kn_ptr, c, s, eps, HKV, D, HALF,
                                    BLOCK_HKV, BLOCK_D, BLOCK_HALF, NORM)
        k_dst = ck_ptr + cache_row + hk * scache_h + d
        tl.store(k_dst, k1.to(k_dst.dtype.element_ty), mask=(hk < HKV) & (d < HALF))
        tl.store(k_dst + HALF, k2.to(k_dst.dtype.element_ty), mask=(hk < HKV) & (d < HALF))


def _check(q, k, v, cos, sin, cache_k, cache_v, start, q_norm_weight, k_norm_weight) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"rope_cache_write: q must be [B, T, Hq, D] and k, v [B, T, Hkv, D]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, t, _, d = q.shape
    if d % 2:
        raise ValueError(f"rope_cache_write: head_dim must be even, got {d}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != (b, t, d // 2) or \
            sin.shape != cos.shape:
        raise ValueError(f"rope_cache_write: cos and sin must be fp32 [{b}, {t}, {d // 2}], got {cos.dtype} "
                         f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    if cache_k.dim() != 4 or cache_v.shape != cache_k.shape or cache_k.shape[0] != b or \
            cache_k.shape[2:] != k.shape[2:]:
        raise ValueError(f"rope_cache_write: the cache must be [{b}, S, {k.shape[2]}, {d}] for k and v, got "
                         f"{tuple(cache_k.shape)} and {tuple(cache_v.shape)}")
    if len({q.dtype, k.dtype, v.dtype, cache_k.dtype, cache_v.dtype}) != 1:
        raise TypeError("rope_cache_write: q, k, v and the cache must share one dtype")
    if start.shape != (b,) or start.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_cache_write: start must be integer [{b}], got {start.dtype} {tuple(start.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_cache_write: give both q and k norm weights (Qwen3) or neither")
    if q_norm_weight is not None and (q_norm_weight.shape != (d,) or k_norm_weight.shape != (d,)):
        raise ValueError(f"rope_cache_write: the q/k norm weights must be [{d}]")
    for name, x in (("q", q), ("k", k), ("v", v), ("cache", cache_k), ("cache", cache_v)):
        if x.stride(-1) != 1:
            raise ValueError(f"rope_cache_write: {name} must be contiguous in its last dimension")


def rope_cache_write(q, k, v, cos, sin, cache_k, cache_v, start, q_norm_weight=None, k_norm_weight=None,
                     eps: float = 1e-6) -> torch.Tensor:
    """Rotated q [B, T, Hq, D] (new, contiguous); k rotated and v written into cache_k, cache_v [B, S, Hkv, D] at
    positions start[b] + t. q, k, v may be strided views (the columns of one packed q/k/v product); with
    q_norm_weight and k_norm_weight, each head is RMS-normalised first (eps theirs). Positions past the cache
    are the caller's to prevent (`generate` sizes the cache for prompt + new tokens)."""
    check_device("rope_cache_write", q)
    _check(q, k, v, cos, sin, cache_k, cache_v, start, q_norm_weight, k_norm_weight)
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty((b, t, hq, d), device=q.device, dtype=q.dtype)
    norm = q_norm_weight is not None
    qn = q_norm_weight.contiguous() if norm else cos   # unread without NORM
    kn = k_norm_weight.contiguous() if norm else cos
    cos, sin = cos.contiguous(), sin.contiguous()
    if b * t > 0:
        _rope_cache_kernel[(b * t, 2)](
            q, k, v, cos, sin, qn, kn, out, cache_k, cache_v, start, t, hq, hkv, d, d // 2, float(eps),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1),
            out.stride(0), out.stride(1), out.stride(2), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2),
            BLOCK_HQ=next_power_of_2(hq), BLOCK_HKV=next_power_of_2(hkv), BLOCK_D=next_power_of_2(d),
            BLOCK_HALF=next_power_of_2(d // 2), NORM=norm, num_warps=4, **pdl_flags(q),
        )
    return out


def rope_cache_write_reference(q, k, v, cos, sin, cache_k, cache_v, start, q_norm_weight=None,
                               k_norm_weight=None, eps: float = 1e-6) -> torch.Tensor:
    """fp64 reference: q's rotation returned in fp64, and k's (fp64, rounded to the cache's dtype) and v written
    into the cache."""
    def norm(x, w):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double() if w is not None else x
    rq = apply_rope_reference(norm(q, q_norm_weight), cos, sin)
    rk = apply_rope_reference(norm(k, k_norm_weight), cos, sin)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    pos = start.long()[:, None] + torch.arange(q.shape[1], device=q.device)
    cache_k[rows, pos] = rk.to(cache_k.dtype)
    cache_v[rows, pos] = v.to(cache_v.dtype)
    return rq

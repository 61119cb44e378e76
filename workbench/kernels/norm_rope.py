"""`norm_rope(x, weight, cos, sin, eps)`: a training forward's per-head q/k RMSNorm (Qwen3) and RoPE in one pass,
forward and backward.

Unfused, the norm and the rotation each read and write every head of q and k, forward and backward: at the
Qwen3-1.7B shape, 16k tokens, eight passes over 6 KB a token per layer, and the norm ran one 128-wide row per
program (fused, less than half the time: BENCHMARKS.md, "Numbers behind the code"). Fused, a program takes all heads of a token: one read
and one write forward, two reads and one write backward.

Numerics contract (modes `invariant` for `rms_norm` and `apply_rope`; `Attention` calls this only then):
- Forward: the bits of apply_rope(rms_norm(x, weight, eps), cos, sin), every head row on its own:
  `sum_of_squares` over the head (the pairwise tree `rms_norm` and `rope_cache_write` use for head-wide rows,
  whose bits no layout changes), rstd = 1 / sqrt(sum / D + eps), n = x * rstd rounded to the dtype,
  y = n * weight rounded, then `apply_rope`'s rotation (`rotate`, its FMAs written out) on the rounded halves
  against the fp32 tables, cast once. No output depends on another token, the batch or padding.
- Backward, in fp32 with the roundings treated as the identity: the inverse rotation of d(out) (not rounded
  to the dtype between the two ops, as the unfused backward does), then `rms_norm`'s formulas:
  g = dy * weight, dx = rstd * (g - n * mean(g * n)) with n = x * rstd, cast once: each row its own, so the
  same bits whatever the batch. d(weight) = sum over rows of dy * round(n): each program sums its tokens (a
  tree over a tile's tokens, the tiles in order, then a tree over the heads), the programs' partial sums added
  by one fp32 torch reduction: deterministic run to run (a sum over the batch: not batch invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, interpreting, next_power_of_2, pdl_enter, pdl_flags, sum_of_squares
from .rmsnorm import rms_norm_reference
from .rope import apply_rope_reference, rotate


@triton.jit
def _norm_rope_fwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr, T, H, D, HALF, eps,
    stride_xt, stride_xh, stride_ct, stride_st,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, TOKENS: tl.constexpr,
    PDL: tl.constexpr,
):
    # TOKENS tokens per program, all heads: [TOKENS, BLOCK_H, .] blocks of elementwise ops, each head row's sum
    # of squares over the row alone.
    pdl_enter(PDL)
    t = (tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS))[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    rows = (t < T) & (h < H)
    x_row = x_ptr + t * stride_xt + h * stride_xh
    full = tl.arange(0, BLOCK_D)[None, None, :]
    x = tl.load(x_row + full, mask=rows & (full < D), other=0.0).to(tl.float32)
    ss = sum_of_squares(tl.reshape(x, (TOKENS * BLOCK_H, BLOCK_D)), TOKENS * BLOCK_H, BLOCK_D)
    rstd = tl.reshape(1.0 / tl.sqrt(ss / D + eps), (TOKENS, BLOCK_H, 1))
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    half = rows & (d < HALF)
    x1 = tl.load(x_row + d, mask=half, other=0.0)
    x2 = tl.load(x_row + HALF + d, mask=half, other=0.0)
    w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    # rms_norm's roundings (n, then weight * n), then apply_rope's arithmetic on the rounded halves.
    y1 = ((x1.to(tl.float32) * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
    y2 = ((x2.to(tl.float32) * rstd).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype).to(tl.float32)
    tmask = (t < T) & (d < HALF)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=tmask, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + d, mask=tmask, other=0.0)
    o_row = out_ptr + (t * H + h) * (2 * HALF)
    o1, o2 = rotate(y1, y2, c, s)
    tl.store(o_row + d, o1.to(out_ptr.dtype.element_ty), mask=half)
    tl.store(o_row + HALF + d, o2.to(out_ptr.dtype.element_ty), mask=half)
    tl.store(rstd_ptr + t * H + h, rstd, mask=rows)


@triton.jit
def _norm_rope_bwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, do_ptr, dx_ptr, dw_part_ptr, T, H, D, HALF,
    stride_xt, stride_xh, stride_ct, stride_st,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, TOKENS: tl.constexpr, TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    # A program owns TOKENS consecutive tokens, TILE at a time; d(out), dx are contiguous [T, H, D].
    pdl_enter(PDL)
    pid = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    dw1 = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_H, BLOCK_HALF), dtype=tl.float32)
    for i in range(0, TOKENS, TILE):
        t = (pid.to(tl.int64) * TOKENS + i + tl.arange(0, TILE))[:, None, None]
        rows = (t < T) & (h < H)
        half = rows & (d < HALF)
        tmask = (t < T) & (d < HALF)
        c = tl.load(cos_ptr + t * stride_ct + d, mask=tmask, other=0.0)
        s = tl.load(sin_ptr + t * stride_st + d, mask=tmask, other=0.0)
        g_row = (t * H + h) * (2 * HALF)
        do1 = tl.load(do_ptr + g_row + d, mask=half, other=0.0).to(tl.float32)
        do2 = tl.load(do_ptr + g_row + HALF + d, mask=half, other=0.0).to(tl.float32)
        dy1 = do1 * c + do2 * s  # the rotation's transpose: by -angle
        dy2 = do2 * c - do1 * s
        x_row = x_ptr + t * stride_xt + h * stride_xh
        rstd = tl.load(rstd_ptr + t * H + h, mask=rows, other=0.0)
        n1 = tl.load(x_row + d, mask=half, other=0.0).to(tl.float32) * rstd
        n2 = tl.load(x_row + HALF + d, mask=half, other=0.0).to(tl.float32) * rstd
        g1 = dy1 * w1
        g2 = dy2 * w2
        mean = (tl.sum(g1 * n1, axis=2) + tl.sum(g2 * n2, axis=2))[:, :, None] / D
        tl.store(dx_ptr + g_row + d, (rstd * (g1 - n1 * mean)).to(dx_ptr.dtype.element_ty), mask=half)
        tl.store(dx_ptr + g_row + HALF + d, (rstd * (g2 - n2 * mean)).to(dx_ptr.dtype.element_ty), mask=half)
        dw1 += tl.sum(dy1 * n1.to(dx_ptr.dtype.element_ty).to(tl.float32), axis=0)
        dw2 += tl.sum(dy2 * n2.to(dx_ptr.dtype.element_ty).to(tl.float32), axis=0)
    dd = tl.arange(0, BLOCK_HALF)
    tl.store(dw_part_ptr + pid * 2 * HALF + dd, tl.sum(dw1, axis=0), mask=dd < HALF)
    tl.store(dw_part_ptr + pid * 2 * HALF + HALF + dd, tl.sum(dw2, axis=0), mask=dd < HALF)


# Elements of a program's block: forward, one token's heads (a 16 x 128 q); backward, a tile as wide, 16 tiles a
# program (its d(weight) partial is summed in registers): the fastest of the blocks and tile counts tried
# (BENCHMARKS.md, "Numbers behind the code"). The interpreter's cost is
# per program step: 32 tokens a program. Functions of the head count and width only: a row's bits are its own
# either way.
_GPU_BLOCK = 2048
_GPU_TILES = 16
_INTERPRETER_TOKENS = 32


def _tokens_per_block(block_h: int, width: int) -> int:
    return _INTERPRETER_TOKENS if interpreting() else max(1, _GPU_BLOCK // (block_h * width))


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return {"forward": f"{_INTERPRETER_TOKENS} tokens" if interpreting() else f"{_GPU_BLOCK} elements",
            "backward": "one tile" if interpreting() else f"{_GPU_TILES} tiles of {_GPU_BLOCK // 2} elements",
            "num_warps": 4}


def _views(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [..., H, D] as [T, H, D] (any token and head strides), cos/sin as [T, D/2]."""
    h, d = x.shape[-2:]
    try:
        x3 = x.view(-1, h, d)
    except RuntimeError:
        raise ValueError(f"norm_rope: x with shape {tuple(x.shape)} and strides {tuple(x.stride())} cannot be seen "
                         "as [tokens, heads, head_dim] without a copy; call .contiguous() on it first") from None
    c2, s2 = cos.reshape(-1, d // 2), sin.reshape(-1, d // 2)
    if c2.stride(-1) != 1 or s2.stride(-1) != 1:
        c2, s2 = c2.contiguous(), s2.contiguous()
    return x3, c2, s2


def _forward(x, weight, cos, sin, eps):
    x3, c2, s2 = _views(x, cos, sin)
    t, h, d = x3.shape
    out = torch.empty((t, h, d), device=x.device, dtype=x.dtype)
    rstd = torch.empty((t, h), device=x.device, dtype=torch.float32)
    block_h = next_power_of_2(h)
    tokens = _tokens_per_block(block_h, next_power_of_2(d))
    if t > 0:
        _norm_rope_fwd_kernel[(triton.cdiv(t, tokens),)](
            x3, weight, c2, s2, out, rstd, t, h, d, d // 2, float(eps),
            x3.stride(0), x3.stride(1), c2.stride(0), s2.stride(0),
            BLOCK_H=block_h, BLOCK_D=next_power_of_2(d), BLOCK_HALF=next_power_of_2(d // 2), TOKENS=tokens,
            num_warps=4, **pdl_flags(x3),
        )
    return out.view(x.shape), rstd


def _backward(x, weight, cos, sin, rstd, dout):
    x3, c2, s2 = _views(x, cos, sin)
    t, h, d = x3.shape
    do3 = dout.reshape(t, h, d).contiguous()
    dx = torch.empty((t, h, d), device=x.device, dtype=x.dtype)
    block_h, block_half = next_power_of_2(h), next_power_of_2(d // 2)
    tile = _tokens_per_block(block_h, block_half)
    tokens = tile if interpreting() else tile * _GPU_TILES
    n_prog = max(triton.cdiv(t, tokens), 1)
    dw_part = torch.zeros((n_prog, d), device=x.device, dtype=torch.float32)
    if t > 0:
        _norm_rope_bwd_kernel[(n_prog,)](
            x3, weight, c2, s2, rstd, do3, dx, dw_part, t, h, d, d // 2,
            x3.stride(0), x3.stride(1), c2.stride(0), s2.stride(0),
            BLOCK_H=block_h, BLOCK_HALF=block_half, TOKENS=tokens, TILE=tile, num_warps=4, **pdl_flags(x3),
        )
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


class NormRopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        out, rstd = _forward(x, weight, cos, sin, eps)
        ctx.save_for_backward(x, weight, cos, sin, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        dx, dw = _backward(x, weight, cos, sin, rstd, dout)
        return dx, dw, None, None, None


def _check(x, weight, cos, sin, eps) -> None:
    check_float("norm_rope", "x", x)
    check_float("norm_rope", "weight", weight)
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"norm_rope: weight must share x's dtype and device, got {weight.dtype} on {weight.device} "
                        f"for x {x.dtype} on {x.device}")
    if x.dim() < 2 or x.shape[-1] % 2 or weight.shape != x.shape[-1:] or x.stride(-1) != 1:
        raise ValueError(f"norm_rope: x must be [..., heads, head_dim] (even head_dim, contiguous in it) and weight "
                         f"[head_dim]; got x {tuple(x.shape)} strides {tuple(x.stride())}, weight "
                         f"{tuple(weight.shape)}")
    want = (*x.shape[:-2], x.shape[-1] // 2)
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dtype != torch.float32 or tuple(tab.shape) != want or tab.device != x.device:
            raise ValueError(f"norm_rope: {name} must be fp32 {want} on {x.device}, got {tab.dtype} "
                             f"{tuple(tab.shape)} on {tab.device}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"norm_rope: eps must be a positive number, got {eps!r}")


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              eps: float = 1e-6) -> torch.Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) for x [..., H, D] (its invariant kernels' bits), in one
    pass; differentiable in x and weight. A new contiguous tensor of x's shape."""
    _check(x, weight, cos, sin, eps)
    check_device("norm_rope", x)
    return NormRopeFn.apply(x, weight.contiguous(), cos, sin, float(eps))


def norm_rope_reference(x, weight, cos, sin, eps: float = 1e-6) -> torch.Tensor:
    """fp64 reference, no intermediate rounding."""
    return apply_rope_reference(rms_norm_reference(x, weight, eps), cos, sin)

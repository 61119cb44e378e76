"""`apply_rope(x, cos, sin)`: rotary position embedding (the half-split form of Hugging Face's Llama, Qwen2 and Qwen3).

x has shape [..., H, D] (heads, head dim); cos and sin have shape [..., D/2]
with the same leading dims (one row per token, so every token may carry its
own absolute position), and are fp32. With x = [x1, x2] split in halves:
    out1 = x1 * cos - x2 * sin,  out2 = x2 * cos + x1 * sin.

Numerics contract (mode `invariant`):
- x is upcast to fp32, the tables stay fp32 (Hugging Face casts them to bf16
  first; we do not: fp32 tables, one rounding), each output is one explicit
  FMA in fp32, out1 = fma(x1, cos, -(x2 * sin)), out2 = fma(x2, cos, x1 * sin)
  (`rotate`, shared with `rope_cache_write` and `norm_rope`), cast once. Left
  to the compiler, which product of a sum it fuses depends on the kernel
  around it (measured: `norm_rope`'s out2 differed from this kernel's in 27 of
  8M elements), so the rounding is written down.
- Elementwise per token and head: no dependence on other tokens or the batch
  (one token per program on a GPU, a fixed 32 in the interpreter).
- Backward is the inverse rotation, the same kernel with sin negated (exact).
- `rope_cos_sin` builds the tables from integer positions and `rope_inv_freq`'s
  frequencies (Hugging Face's formulas, RoPE scaling included) with fp32 math; the
  same position gives the same bits in training, prefill and decode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, check_same, interpreting, next_power_of_2, pdl_enter, pdl_flags
from .mode import get_mode


@triton.jit
def rotate(x1, x2, c, s):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in fp32, each one FMA over an exact-then-rounded product (the contract)."""
    return tl.fma(x1, c, -(x2 * s)), tl.fma(x2, c, x1 * s)


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, o_ptr,
    stride_xt, stride_xh, stride_ct, stride_st, T, H, HALF,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INVERSE: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    # ROWS tokens per program, all heads, as one [ROWS, BLOCK_H, BLOCK_D] block of elementwise ops (1 token on a
    # GPU; more in the interpreter, whose cost is per program step).
    pdl_enter(PDL)
    t = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    tdmask = (t < T) & (d < HALF)
    mask = tdmask & (h < H)
    c = tl.load(cos_ptr + t * stride_ct + d, mask=tdmask, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + d, mask=tdmask, other=0.0)
    if INVERSE:
        s = -s
    x_base = x_ptr + t * stride_xt + h * stride_xh + d
    x1 = tl.load(x_base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF, mask=mask, other=0.0).to(tl.float32)
    o_base = o_ptr + t * H * 2 * HALF + h * 2 * HALF + d
    o1, o2 = rotate(x1, x2, c, s)
    tl.store(o_base, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_base + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


# Tokens per program: one on a GPU; 32 in the interpreter (a fixed number: each element's arithmetic is its own).
_GPU_ROWS, _INTERPRETER_ROWS = 1, 32


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return {"program": f"{_INTERPRETER_ROWS if interpreting() else _GPU_ROWS} token(s), all heads", "num_warps": 4}


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_float("apply_rope", "x", x)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"apply_rope: `{name}` must be an fp32 tensor (tables stay fp32), got {got}")
    check_same("apply_rope", {"x": x, "cos": cos, "sin": sin}, dtype=False)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"apply_rope: x must be [..., heads, head_dim] with an even head_dim, got {tuple(x.shape)}")
    want = (*x.shape[:-2], x.shape[-1] // 2)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(
            f"apply_rope: cos and sin must have shape {want} for x {tuple(x.shape)}, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    h, d = x.shape[-2:]
    if x.stride(-1) != 1:
        raise ValueError(
            f"apply_rope: x must be contiguous in its last dimension, got strides {tuple(x.stride())}; "
            "call .contiguous() on it first"
        )
    x3 = x.reshape(-1, h, d)
    c2 = cos.reshape(-1, d // 2)
    s2 = sin.reshape(-1, d // 2)
    if c2.stride(-1) != 1 or s2.stride(-1) != 1:
        c2, s2 = c2.contiguous(), s2.contiguous()
    out = torch.empty(x3.shape, device=x.device, dtype=x.dtype)
    rows = _INTERPRETER_ROWS if interpreting() else _GPU_ROWS
    if x3.shape[0] > 0:
        _rope_kernel[(triton.cdiv(x3.shape[0], rows),)](
            x3, c2, s2, out, x3.stride(0), x3.stride(1), c2.stride(0), s2.stride(0), x3.shape[0], h, d // 2,
            BLOCK_H=next_power_of_2(h), BLOCK_D=next_power_of_2(d // 2), INVERSE=inverse, ROWS=rows, num_warps=4,
            **pdl_flags(x3),
        )
    return out.view(x.shape)


class RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        check_device("apply_rope", x)
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _launch(dout.contiguous(), cos, sin, inverse=True), None, None


def apply_rope_invariant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check(x, cos, sin)
    return RopeFn.apply(x, cos, sin)


def apply_rope_standard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's form: tables cast to x's dtype, rotate_half, products and sum in x's dtype."""
    _check(x, cos, sin)
    c = torch.cat([cos, cos], -1).unsqueeze(-2).to(x.dtype)
    s = torch.cat([sin, sin], -1).unsqueeze(-2).to(x.dtype)
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat([-x2, x1], -1) * s


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x[..., H, D] by the per-token fp32 tables, by the kernel the mode picks for `apply_rope`."""
    if get_mode("apply_rope") == "standard":
        return apply_rope_standard(x, cos, sin)
    return apply_rope_invariant(x, cos, sin)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp64 reference."""
    x1, x2 = x.double().chunk(2, -1)
    c = cos.double().unsqueeze(-2)
    s = sin.double().unsqueeze(-2)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None, device=None) -> torch.Tensor:
    """fp32 inverse frequencies [head_dim/2], op for op as Hugging Face's RoPE init functions compute them.

    `scaling` is a Hugging Face `rope_scaling` dict: None or rope_type 'default' (plain RoPE), 'linear'
    (every frequency divided by `factor`) or 'llama3' (low frequencies divided by `factor`, high ones
    kept, a smooth blend between). Any other type is refused rather than silently ignored.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_inv_freq: RoPE scaling type {kind!r} is not supported; supported: default, linear, llama3")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin tables [..., head_dim/2] for integer positions and `rope_inv_freq`'s frequencies."""
    if positions.dtype.is_floating_point:
        raise TypeError(f"rope_cos_sin: positions must be integers, got {positions.dtype}")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1:
        raise TypeError(f"rope_cos_sin: inv_freq must be a 1-D fp32 tensor (rope_inv_freq), got {inv_freq.dtype} "
                        f"{tuple(inv_freq.shape)}")
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()

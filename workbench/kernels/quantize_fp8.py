"""`quantize_fp8(x)`: the fp8 sampler's activation quantization, dynamic per token, in one launch.

Numerics contract: the bits of `quantize_fp8_reference` (generation/fp8.py's `quantize_rows`, vLLM's dynamic
per-token fp8): per row of x [M, K], s = max(amax|x_row| / 448, 1 / (448 * 512)) in fp32, codes
e4m3(clamp(x / s, -448, 448)) rounded to nearest, ties to even. Every step is exact or correctly rounded, so
there is one right answer and the kernel gives it:
- the row's amax is a max of absolute values (exact, in any order);
- both divisions are IEEE fp32 divisions (`div_rn`: Triton's `/` on fp32 is an approximate division on a GPU);
- the rounding to e4m3 is done in fp32 arithmetic, then the rounded value (exactly representable) is cast: a
  cast of an e4m3 value is exact whatever its rounding mode. Rounding here, not in the cast, because Triton's
  interpreter casts fp32 -> float8e4nv by truncating and adding half an ulp, without ties to even, without a
  carry into the exponent and without rounding subnormals: so the CPU tests hold the kernel's own rounding to
  the reference's bits, ties and subnormals included, as the GPU runs it.
A row's bits depend on that row alone. One program per row, the whole row in one block (K up to 6144 at the
Qwen3-1.7B widths). Finite inputs (an inf or NaN makes its row's codes NaN in the reference). Forward only:
the sampler quantizes activations under no_grad, so there is no `autograd.Function`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, next_power_of_2, pdl_enter, pdl_flags, rows_view

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn."""
MIN_TOKEN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""vLLM's floor on a token's scale (an all-zero row quantizes to zeros, not NaN)."""
_MAX, _FLOOR = tl.constexpr(FP8_MAX), tl.constexpr(MIN_TOKEN_SCALE)   # a kernel reads constexpr globals alone


@triton.jit
def round_to_e4m3(q):
    """q (fp32, |q| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in fp32.

    For |q| in [2^e, 2^(e+1)), e >= -6, e4m3's spacing is 2^(e-3); below 2^-6 (its subnormals) it stays 2^-9.
    magic = 2^(e+20) is the fp32 value whose spacing is 2^(e-3): |q| + magic lies in [magic, 2 * magic), so that
    one fp32 addition rounds |q| to a multiple of 2^(e-3), to nearest and ties to even (the sum's last bit is the
    e4m3 code's last bit), and subtracting magic again is exact (Triton emits no fast-math flags: the sm90 PTX
    keeps both steps). The sign goes back as a bit (Triton's unary minus is 0 - r, which would turn -0 into +0)."""
    bits = q.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    e = tl.maximum((mag >> 23) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = (mag.to(tl.float32, bitcast=True) + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits ^ mag)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_fp8_kernel(x_ptr, codes_ptr, scale_ptr, stride_x, stride_c, K, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), _MAX), _FLOOR)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -_MAX), _MAX)
    codes = round_to_e4m3(q).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(codes_ptr + row * stride_c + cols, codes.to(tl.uint8, bitcast=True), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes float8_e4m3fn [M, K], scales fp32 [M, 1]) of the rows of x [..., K] (bf16 or fp32)."""
    check_device("quantize_fp8", x)
    check_float("quantize_fp8", "x", x)
    x2 = rows_view("quantize_fp8", "x", x)
    m, k = x2.shape
    codes = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    if x2.numel():
        # Stored through a uint8 view: the interpreter hands kernels numpy arrays, and numpy has no float8.
        _quantize_fp8_kernel[(m,)](x2, codes.view(torch.uint8), scale, x2.stride(0), codes.stride(0), k,
                                   BLOCK=next_power_of_2(k), num_warps=4 if k <= 2048 else 8, **pdl_flags(x2))
    return codes, scale


def quantize_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch form: fp32 ATen ops, each exact or correctly rounded, the cast to e4m3 ties to even."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    # The divisor a tensor on x's device, not a Python number: on a GPU, ATen divides by a host scalar as a product
    # with its reciprocal, one ulp off the IEEE quotient for some rows, and the contract is the quotient.
    scale = (x32.abs().amax(dim=-1, keepdim=True) / x32.new_tensor(FP8_MAX)).clamp_min(MIN_TOKEN_SCALE)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale

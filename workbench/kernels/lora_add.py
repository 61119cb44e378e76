"""`lora_add(base, low, scale)` = base + scale * low: where a LoRA adapter's low-rank product joins the frozen
projection's output (`models/lora.py`), forward and backward.

Numerics contract (mode `invariant`), per element:
- base and low (one dtype) are upcast to fp32 exactly; scale is fp32(scale).
- p = low * scale in fp32 (rounded), then p + base in fp32 (rounded), cast once to the dtype (on the GPU round to
  nearest even, as PyTorch's casts). Two roundings in fp32, never one fused multiply-add: the kernel is compiled with
  `enable_fp_fusion=False`, so the compiler may not contract the pair into an FMA (which rounds once and gives
  other bits). The interpreter computes the same two numpy operations, but its final cast to bf16 truncates:
  on CPU compare with a tolerance, bitwise only with itself (tests/test_gpu_lora.py checks the formula bitwise).
- Elementwise, no reduction: an element depends on its own inputs alone, whatever the batch.
- Backward: d_base = dout (the sum's derivative is 1, and a cast of a dtype value to fp32 and back is exact);
  d_low = dtype(fp32(dout) * fp32(scale)), ATen's multiply of a bf16/fp32 tensor by a Python scalar (upcast,
  one fp32 multiply, one rounding): elementwise on either device.

One pass over 3 tensors (read base and low, write the sum): 6 bytes an element in bf16, where the same formula
written as torch operations (upcast copy, multiply, add, cast) moves ~30.
Mode `standard` is what PEFT's `Linear` does: `base + low * scale` in the dtype (two roundings to bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, check_same, interpreting, pdl_enter, pdl_flags, rows_view
from .mode import get_mode


@triton.jit
def _lora_add_kernel(b_ptr, l_ptr, o_ptr, stride_b, stride_l, stride_o, N, scale, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    base = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    low = tl.load(l_ptr + row * stride_l + cols, mask=mask, other=0.0).to(tl.float32)
    p = low * scale
    tl.store(o_ptr + row * stride_o + cols, (p + base).to(o_ptr.dtype.element_ty), mask=mask)


def _block() -> int:
    return 256 if interpreting() else 1024


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return {"block": _block(), "num_warps": 4, "enable_fp_fusion": False}


def _check(base: torch.Tensor, low: torch.Tensor, scale: float) -> None:
    check_float("lora_add", "base", base)
    check_float("lora_add", "low", low)
    check_same("lora_add", {"base": base, "low": low})
    if base.shape != low.shape:
        raise ValueError(f"lora_add: base and low must have one shape, got {tuple(base.shape)} and "
                         f"{tuple(low.shape)}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale != scale:
        raise ValueError(f"lora_add: scale must be a real number (lora_alpha / lora_rank), got {scale!r}")


def _launch(base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
    b2 = rows_view("lora_add", "base", base)
    l2 = rows_view("lora_add", "low", low)
    m, n = b2.shape
    out = torch.empty((m, n), device=base.device, dtype=base.dtype)
    block = _block()
    if m > 0 and n > 0:
        _lora_add_kernel[(m, triton.cdiv(n, block))](
            b2, l2, out, b2.stride(0), l2.stride(0), out.stride(0), n, float(scale),
            BLOCK=block, num_warps=4, enable_fp_fusion=False, **pdl_flags(b2),
        )
    return out.view(base.shape)


class LoraAddFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
        check_device("lora_add", base)
        ctx.scale = float(scale)
        return _launch(base, low, scale)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        return dout, dout * ctx.scale, None


def lora_add_invariant(base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
    _check(base, low, scale)
    return LoraAddFn.apply(base, low, scale)


def lora_add_standard(base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
    _check(base, low, scale)
    return base + low * scale


def lora_add(base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
    """base + scale * low, by the kernel the mode picks for `lora_add`."""
    if get_mode("lora_add") == "standard":
        return lora_add_standard(base, low, scale)
    return lora_add_invariant(base, low, scale)


def lora_add_reference(base: torch.Tensor, low: torch.Tensor, scale: float) -> torch.Tensor:
    """fp64 reference."""
    return base.double() + scale * low.double()

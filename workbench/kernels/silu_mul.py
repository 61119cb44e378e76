"""`silu_mul(gate, up)` = silu(gate) * up, the SwiGLU MLP of Llama, Qwen2 and Qwen3; forward and backward.

Numerics contract (mode `invariant`), with Hugging Face's rounding points:
- gate and up are read and upcast to fp32.
- Rounding point 1: s = gate / (1 + exp(-gate)) in fp32, cast to the input
  dtype (as PyTorch's `F.silu` on a bf16 tensor).
- Rounding point 2: out = s * up in fp32, cast once.
- Elementwise, no reduction: each element depends only on its own inputs.
- Backward, in fp32, each gradient cast once:
  d_gate = dout * up * sig(g) * (1 + g * (1 - sig(g))), d_up = dout * round(s).

gate and up may be views into one merged [..., 2I] projection (any row
stride), but each must be contiguous in its last dimension.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .runtime import check_device, check_float, check_same, interpreting, pdl_enter, pdl_flags, rows_view
from .mode import get_mode


@triton.jit
def _silu_mul_fwd_kernel(
    g_ptr, u_ptr, o_ptr, stride_g, stride_u, stride_o, N,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (s * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(
    g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr,
    stride_g, stride_u, stride_do, stride_dg, stride_du, N,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + row * stride_do + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    # s exactly as the forward computed it (d_up = dout * round(s)).
    s = (g / (1.0 + tl.exp(-g))).to(dg_ptr.dtype.element_ty).to(tl.float32)
    dg = do * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_du + cols, (do * s).to(du_ptr.dtype.element_ty), mask=mask)


def _block() -> int:
    return 256 if interpreting() else 1024


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return {"block": _block(), "num_warps": 4}


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float("silu_mul", "gate", gate)
    check_float("silu_mul", "up", up)
    check_same("silu_mul", {"gate": gate, "up": up})
    if gate.shape != up.shape:
        raise ValueError(
            f"silu_mul: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )


class SiluMulFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        check_device("silu_mul", gate)
        g2 = rows_view("silu_mul", "gate", gate)
        u2 = rows_view("silu_mul", "up", up)
        m, n = g2.shape
        out = torch.empty((m, n), device=gate.device, dtype=gate.dtype)
        block = _block()
        if m > 0 and n > 0:
            _silu_mul_fwd_kernel[(m, triton.cdiv(n, block))](
                g2, u2, out, g2.stride(0), u2.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl_flags(g2),
            )
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        g2, u2 = ctx.saved_tensors
        m, n = g2.shape
        do2 = dout.reshape(m, n).contiguous()
        dg = torch.empty((m, n), device=g2.device, dtype=g2.dtype)
        du = torch.empty_like(dg)
        block = _block()
        if m > 0 and n > 0:
            _silu_mul_bwd_kernel[(m, triton.cdiv(n, block))](
                g2, u2, do2, dg, du,
                g2.stride(0), u2.stride(0), do2.stride(0), dg.stride(0), du.stride(0), n,
                BLOCK=block, num_warps=4, **pdl_flags(g2),
            )
        return dg.view(ctx.shape), du.view(ctx.shape)


def silu_mul_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    return SiluMulFn.apply(gate, up)


def silu_mul_standard(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, by the kernel the mode picks for `silu_mul`."""
    if get_mode("silu_mul") == "standard":
        return silu_mul_standard(gate, up)
    return silu_mul_invariant(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fp64 reference."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()

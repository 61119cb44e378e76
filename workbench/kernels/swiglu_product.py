"""`swiglu_product(x, gate_up)` = silu(x @ gate.T) * (x @ up.T), the SwiGLU MLP's two products and its
activation in one launch, for forwards without autograd at decode sizes (generation).

Unfused, a decode step runs the packed gate/up product, then `silu_mul` over its [B, 2I] output: a second
launch a layer that reads back what the first just wrote. Here each program computes a tile of gate's columns
and the same columns of up (two accumulators over one read of x's tile), and applies the activation in its
epilogue.

Numerics contract (modes `invariant` for `linear` and `silu_mul`; `MLP` calls this only then): the bits of
`silu_mul(linear(x, gate), linear(x, up))`:
- each accumulator is `linear`'s chain of k-steps for its column (`dot_step`, K blocks in increasing order),
  rounded to the dtype once, as `linear` rounds its output;
- then `silu_mul`'s arithmetic on the rounded values, written the same way: s = g / (1 + exp(-g)) in fp32,
  rounded; s * u in fp32, rounded once.
On Hopper a product's bits do not depend on its tiles (`matmul.py`), so this kernel's tiles may differ from the
product's; on other GPUs the product has one tile config for every M, and this kernel is not used (the caller
falls back). The interpreter runs the product's own config (`matmul_config`), whose BLOCK_K its fixed-order
sums follow. The GPU test holds it to the unfused ops bit for bit (`tests/test_gpu_model.py`).

Inference only: no `autograd.Function` (a training forward runs the two products and `silu_mul`, which have
their backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import interpreting, l2_prefetch, pdl_enter, pdl_flags
from .matmul import _descriptor, _prefetch_k, _tile_origin, dot_step
from .matmul_tiles import MatmulConfig, _device_capability, _uses_buckets, matmul_config

# Decode sizes only (larger M runs the packed product, whose persistent tiles are faster there, then silu_mul).
# Two [BLOCK_N, BLOCK_K] weight tiles a stage: the bucket's tiles with BLOCK_N halved fit the shared memory.
# Chosen on an H200 by `tools/tune/tune_matmul.py --swiglu-tiles` (every tile gave the unfused ops' bits).
MAX_ROWS = 512
_CONFIGS: tuple[tuple[int, MatmulConfig], ...] = (
    (64, MatmulConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=4)),
    (MAX_ROWS, MatmulConfig(128, 64, 64, group_m=8, num_warps=4, num_stages=6)),
)


@triton.jit(do_not_specialize=["K"])
def _swiglu_product_kernel(
    a_desc, b_desc, c_desc, M, INTER, K, b_ptr, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PREFETCH_K: tl.constexpr, PDL: tl.constexpr,
):
    # b_desc: the packed [2 INTER, K] weight, gate's rows then up's. Tile (off_m, off_n) of the [M, INTER] output
    # reads gate's rows off_n.. and up's rows INTER + off_n..; where INTER is no multiple of BLOCK_N, gate's last
    # tile reads into up's rows, for columns the store clips.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(INTER, BLOCK_N)
    off_m, off_n = _tile_origin(tl.program_id(0), num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
    if PREFETCH_K > 0:
        # As `_matmul_tma_kernel`: the weights are no output of the kernel before, so they may start moving
        # to the L2 before the PDL wait.
        rows = ((off_n + tl.arange(0, BLOCK_N)) % INTER).to(tl.int64)
        ks = tl.arange(0, PREFETCH_K // 64)[None, :] * 64
        l2_prefetch(b_ptr + rows[:, None] * stride_bn + ks)
        l2_prefetch(b_ptr + (INTER + rows)[:, None] * stride_bn + ks)
    pdl_enter(PDL)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        off_k = k * BLOCK_K
        a = a_desc.load([off_m, off_k])
        acc_g = dot_step(a, tl.trans(b_desc.load([off_n, off_k])), acc_g, DOT_IN_FP32, DOT_IN_FP32)
        acc_u = dot_step(a, tl.trans(b_desc.load([INTER + off_n, off_k])), acc_u, DOT_IN_FP32, DOT_IN_FP32)
    # `linear`'s rounding of each product, then `silu_mul`'s two roundings.
    g = acc_g.to(c_desc.dtype).to(tl.float32)
    u = acc_u.to(c_desc.dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(c_desc.dtype).to(tl.float32)
    c_desc.store([off_m, off_n], (s * u).to(c_desc.dtype))


def fused_config(m: int, device: torch.device) -> MatmulConfig | None:
    """The tiles for `m` rows here, or None where the fused product does not run: more than MAX_ROWS rows, or
    a GPU whose product does not let tiles follow M (not Hopper)."""
    if interpreting():
        return matmul_config(m, torch.bfloat16, device)
    if m > MAX_ROWS or device.type != "cuda" or not _uses_buckets(_device_capability(device)):
        return None
    return next(cfg for max_m, cfg in _CONFIGS if m <= max_m)


def swiglu_product(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) [..., I] for x [..., K] and gate_up [2I, K] (gate's rows, then up's), bf16;
    None where the fused kernel does not apply (see `fused_config`; operands TMA cannot read), for the caller
    to run the unfused ops."""
    if x.dtype != torch.bfloat16 or gate_up.dtype != x.dtype or gate_up.shape[0] % 2 or \
            x.shape[-1] != gate_up.shape[1] or x.device != gate_up.device:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    inter = gate_up.shape[0] // 2
    cfg = fused_config(m, x.device)
    if cfg is None or m == 0 or k == 0:
        return None
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    out = torch.empty((m, inter), device=x.device, dtype=x.dtype)
    a_desc, b_desc, c_desc = _descriptor(x2, [bm, bk]), _descriptor(gate_up, [bn, bk]), _descriptor(out, [bm, bn])
    if a_desc is None or b_desc is None or c_desc is None:
        return None
    flags = pdl_flags(x2)
    _swiglu_product_kernel[(triton.cdiv(m, bm) * triton.cdiv(inter, bn),)](
        a_desc, b_desc, c_desc, m, inter, k, gate_up, gate_up.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, DOT_IN_FP32=interpreting(),
        PREFETCH_K=_prefetch_k(m, k, gate_up.t(), True, flags["PDL"]), **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out.view(*x.shape[:-1], inter)


def swiglu_product_reference(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """fp64 reference."""
    g, u = (x.double() @ gate_up.double().t()).chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u

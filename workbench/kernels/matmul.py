"""`linear(x, weight, bias=None)` = x @ weight.T (+ bias), forward and backward.

Numerics contract (mode `invariant`):
- Operands are read in their dtype (bf16 or fp32) and multiplied on the
  tensor cores (bf16) or in IEEE fp32 (`input_precision="ieee"`, never tf32).
- Each output element is accumulated in one fp32 register, over K in blocks
  taken in increasing order: acc = dot(a_0, b_0); acc = dot(a_1, b_1, acc); ...
  (the tensor cores step through each block 16 k at a time, also in order).
  No split-K (but for one gradient, below), no atomics, no run-time autotuning.
- One rounding point: the fp32 accumulator is cast to the output dtype once.
  With a bias (Qwen2's q/k/v projections) the product is kept in fp32, the
  bias added in fp32, and the sum cast once: the one rounding cuBLAS's
  bias epilogue and the CPU's addmm give too. The add is elementwise, so
  rows stay independent of the batch.
- The bf16 tile config may change with M (`matmul_tiles.py`: `MATMUL_BUCKETS`, a fixed table; up to
  512 rows, wide products take `WIDE_BUCKETS`; decode products of 33-256 rows
  `DECODE_WIDTHS`, by their grid's size) on Hopper (sm90) alone, because
  there the per-element chain of k-steps does not depend on the tiles: every
  bucket is checked bitwise against the others (`tests/test_gpu.py`), since a
  row's result must not depend on its bucket.
  The capability is read at run time (once per device): on any other GPU bf16
  takes one config for every M, and fp32 does everywhere, so no row can meet
  another tiling (and TMA is used from sm90 on only). So a row of x gives the
  same bits alone, in any batch, at any position, next to any other rows,
  with or without padding rows.
- Two kernels, one arithmetic: `_matmul_kernel` (pointer loads, any strides) and
  `_matmul_tma_kernel` (TMA loads, optionally persistent, for 16-byte aligned
  row-major operands: the GPU default). They run the same dot chain, so give
  the same bits (checked on the GPU). The fp32-output product of a bias
  takes the pointer kernel (its epilogue needs no shared-memory staging).
- Backward: dx = dy @ W is computed by the same kernel (so it is batch
  invariant too); dW = dy.T @ x reduces over the token dimension in blocks of
  BLOCK_K in order, so it is deterministic run to run; d(bias) is an fp32 sum
  of dy over the tokens (torch's fixed-order reduction). Gradients come out in
  the dtype of the tensor they belong to, except where the weight carries an
  fp32 `main_grad` (Megatron-LM's and Transformer Engine's convention for
  gradient accumulation fused into the weight-gradient product): there dW is
  added to it in the kernel's epilogue (`matmul(..., accumulate=main_grad)`:
  main_grad + the fp32 accumulator, one fp32 add, dW never rounded to bf16),
  and no bf16 gradient is returned. A LoRA adapter's gradient (a weight
  dimension <= 32: few output tiles, each over all the step's tokens) is
  split over K instead (`matmul_split_k`): fp32 partials summed in torch's
  fixed order; deterministic, and no forward value depends on it.
- No choice follows the SMs this process sees (a capped MPS share shows fewer): tiles and split-K slices are
  sized for `matmul_tiles.PINNED_SMS`; only a persistent grid's size follows the visible count, and which
  program computes a tile moves no bit.
- Warp specialization (`_WARP_SPECIALIZE_MAX_K`) moves the loads and the MMAs
  to different warps; each tile's chain of k-steps is the same, so the bits
  are (checked on the GPU with the buckets).
- Under PDL a decode product's programs ask the L2 for the start of their weight rows before they wait for
  the kernel before them (`_PREFETCH_K`): a cache hint, which moves when bytes arrive, never a value.
- Few output tiles (a weight gradient of a narrow projection): on Hopper the
  product takes smaller tiles (`_FEW_TILES`) when the bucket's would leave
  SMs idle, and narrow ones (`_NARROW_N`, <= 32 columns: a LoRA adapter's
  products) when the bucket's 256 columns would be mostly waste; like the
  buckets, they give the same bits (tests/test_gpu.py, tests/test_gpu_lora.py).

In the interpreter (CPU) a dot is `dot_step`'s own (`DOT_IN_FP32`): operands
upcast to fp32 (bf16 products exact), each block's products summed in one
fixed order by elementwise fp32 adds, never numpy's matmul, whose BLAS can
round a row by its place in the tile (OpenBLAS's Haswell kernel does from row
16 on). So a row's bits there follow neither the batch nor the CPU's BLAS
kernel, and the pointer and TMA kernels agree. The final cast truncates:
compare bf16 results with a GPU's with a tolerance, bitwise only with
themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .runtime import check_device, check_float, check_same, interpreting, l2_prefetch, pdl_enter, pdl_flags
from .matmul_tiles import PINNED_SMS, _device_capability, _num_sms, matmul_config
from .mode import get_mode


@triton.jit
def dot_step(a, b, acc, DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b: the one accumulation step of the matmul kernels and of attention's products.

    DOT_IN_FP32 is set only in the interpreter (the GPU runs the two `tl.dot` lines alone). There
    `tl.dot` would be numpy's matmul, whose BLAS may round an output row differently at different
    row positions of the tile (OpenBLAS's Haswell and Zen kernels do, from row 16 on), so a row's
    bits would follow its position in the batch, and the CPU. Instead the operands are upcast to
    fp32 (bf16 arithmetic is wrong there), each product is one fp32 multiply, and the K products of
    an output element are summed in one fixed order, a balanced binary tree over k (pairs
    (2i, 2i+1), then pairs of those sums, ...), each level one elementwise fp32 add of two arrays;
    the block's sum is then added to acc. So its bits depend on the element's own operands alone:
    not on the BLAS, the CPU, the memory layout, the other rows, or numpy's summation order
    (`np.sum`, hence `tl.sum`, picks its order by the reduced axis's stride; it is not used).
    K is a power of two (a tile's arange), at most 2^16.
    """
    if DOT_IN_FP32:
        p = a.to(tl.float32)[:, None, :] * tl.trans(b.to(tl.float32))[None, :, :]  # [M, N, K]
        for _ in tl.static_range(16):
            if p.shape[2] > 1:
                lo, hi = tl.split(tl.reshape(p, p.shape[0], p.shape[1], p.shape[2] // 2, 2))
                p = lo + hi
        return acc + tl.reshape(p, p.shape[0], p.shape[1])
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile_origin(tile, num_pid_m, num_pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Tile index -> its first row and column, in a grouped order (GROUP_M row tiles per column sweep).
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return (first_m + ((tile % width) % group_rows)) * BLOCK_M, ((tile % width) // group_rows) * BLOCK_N


@triton.jit(do_not_specialize=["K", "K_SPLIT"])
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K, K_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_cs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr, ACCUMULATE: tl.constexpr, PDL: tl.constexpr,
):
    # C[M, N] = A[M, K] @ B[K, N] (ACCUMULATE: C += A @ B, C fp32) for any strides. Split K (grid axis 1 > 1):
    # program s takes k in [s * K_SPLIT, (s + 1) * K_SPLIT) and writes its partial product to C + s * stride_cs.
    pdl_enter(PDL)
    pid = tl.program_id(0)
    k_start = tl.program_id(1) * K_SPLIT
    K = tl.minimum(K - k_start, K_SPLIT)
    c_ptr += tl.program_id(1).to(tl.int64) * stride_cs
    # Grouped launch order, for L2 reuse of B tiles; it changes which program
    # computes a tile, never how a tile is computed.
    off_m, off_n = _tile_origin(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns wrap onto valid memory instead of being masked:
    # they feed only output elements that are never stored.
    # int64: a logits product can exceed 2^31 elements.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k_start + offs_k[None, :]).to(tl.int64) * stride_ak
    b_ptrs = b_ptr + (k_start + offs_k[:, None]).to(tl.int64) * stride_bk + cols[None, :] * stride_bn

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
        acc = dot_step(a, b, acc, DOT_IN_FP32, IEEE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if ACCUMULATE:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0) + acc
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# K is never specialized (here and in the pointer kernel). Triton compiles K == 1 (a weight gradient over a
# one-token chunk) as a constant: the k-loop unrolls to one step, and its combiner then folds the epilogue's
# `C + acc` into the MMA's accumulator (dot(a, b, 0) + C -> dot(a, b, C)), where the tensor core adds with
# its own rounding: 1 ulp off the exact `C + a * b` (measured on an H100). That variant of the persistent
# accumulating kernel also needs 273 KiB of shared memory (Hopper has 227). The loads go through TMA
# descriptors or masks, so K's divisibility buys nothing; the chain of k-steps is the same.
@triton.jit(do_not_specialize=["K"])
def _matmul_tma_kernel(
    a_desc, b_desc, c_desc, M, N, K, NUM_PROGRAMS, b_ptr, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_K_MAJOR: tl.constexpr, B_K_MAJOR: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr, ACCUMULATE: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    PREFETCH_K: tl.constexpr, PDL: tl.constexpr,
):
    # The same product through the bulk tensor copy engine (TMA), for aligned
    # operands; optionally persistent (NUM_PROGRAMS < number of tiles). TMA
    # zero-fills outside the tensor, so tails need no masks, and stores are
    # clipped to the tensor. Same dot chain as `_matmul_kernel`: same bits.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PREFETCH_K > 0:
        # Under PDL this program may be placed while the kernel before it still runs (`pdl_enter` waits for
        # it). B, a bf16 weight [N, K] read k-contiguous (b_ptr, with stride_bn between its rows), is no output
        # of that kernel: the first PREFETCH_K of K of the first tile's rows (one 128-byte line per 64
        # elements) start moving to the L2 now, instead of after the wait. Only the bytes' arrival moves.
        _, off_n = _tile_origin(tl.program_id(0), num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        rows = ((off_n + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        l2_prefetch(b_ptr + rows[:, None] * stride_bn + tl.arange(0, PREFETCH_K // 64)[None, :] * 64)
    pdl_enter(PDL)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=WARP_SPECIALIZE,
                         warp_specialize=WARP_SPECIALIZE):
        off_m, off_n = _tile_origin(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            if A_K_MAJOR:
                a = a_desc.load([off_m, off_k])
            else:
                a = tl.trans(a_desc.load([off_k, off_m]))
            if B_K_MAJOR:
                b = tl.trans(b_desc.load([off_n, off_k]))
            else:
                b = b_desc.load([off_k, off_n])
            acc = dot_step(a, b, acc, DOT_IN_FP32, IEEE)
        if ACCUMULATE:
            # C += acc in fp32, by column halves (c_desc's block is [BLOCK_M, BLOCK_N / 2]): a whole fp32
            # 128 x 256 tile staged in shared memory beside the pipeline's buffers would not fit (272 of
            # 227 KiB). The halves' split moves no value between elements.
            lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c_desc.store([off_m, off_n], c_desc.load([off_m, off_n]) + lo)
            c_desc.store([off_m, off_n + BLOCK_N // 2], c_desc.load([off_m, off_n + BLOCK_N // 2]) + hi)
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


# Persistent products with K up to this warp-specialize their tile loop (producer warps issue the TMA loads,
# consumer warps the MMAs; the chain of k-steps is unchanged): faster at K = 2,048 (the q/k/v/o/gate/up
# forwards, most input gradients), slower at K = 6,144 and 16,384 (the down projection's forward, the weight
# gradients), which keep the plain loop (BENCHMARKS.md, "Numbers behind the code"). Never with
# `accumulate`: the loaded C tile on top of the specialized pipeline's buffers needs 273 KiB of shared
# memory, more than Hopper's 227 KiB.
_WARP_SPECIALIZE_MAX_K = 4096
# A decode product's programs prefetch this much of K of their weight rows before the PDL wait
# (`_matmul_tma_kernel`), the same bits at every amount. It pays where products are short (the SmolLM2-135M
# shape) and is neutral at the Qwen3-1.7B shape; much more was slower: the bytes then arrive long before their
# turn and crowd the L2 (BENCHMARKS.md, "Numbers behind the code").
_PREFETCH_K = 256
_PREFETCH_MAX_M = 512


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor | None:
    """A TMA descriptor for a row-major 2-D view, or None where TMA's alignment rules fail."""
    size = t.element_size()
    if t.stride(1) != 1 or (t.stride(0) * size) % 16 or t.data_ptr() % 16 or t.shape[1] * size < 16:
        return None
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
           tma: bool | None = None, accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """a[M, K] @ b[K, N] with the invariant kernel; any strides. `accumulate`: an fp32 [M, N] tensor that
    the product is added to in place (the chain of k-steps starts from its value) and returned.

    tma=None takes the TMA kernel on a GPU of sm90 or newer where the operands
    are aligned, the pointer kernel otherwise. The interpreter runs the pointer
    kernel unless tma=True (both give the same bits there: `dot_step`'s
    fixed-order sum does not see the tiles' memory layout).
    """
    m, k = a.shape
    k2, n = b.shape
    if k != k2 or a.dtype != b.dtype:
        raise ValueError(f"matmul: a {tuple(a.shape)} {a.dtype} and b {tuple(b.shape)} {b.dtype} do not multiply")
    if accumulate is not None:
        if accumulate.dtype != torch.float32 or accumulate.shape != (m, n) or accumulate.device != a.device:
            raise ValueError(f"matmul: `accumulate` must be an fp32 [{m}, {n}] tensor on {a.device}, got "
                             f"{accumulate.dtype} {tuple(accumulate.shape)} on {accumulate.device}")
        c = accumulate
    else:
        c = torch.empty((m, n), device=a.device, dtype=out_dtype or a.dtype)
    if m == 0 or n == 0 or (k == 0 and accumulate is not None):
        return c
    if k == 0:
        return c.zero_()
    cfg = matmul_config(m, a.dtype, a.device, n, k)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    interp = interpreting()
    # TMA (the bulk tensor copy engine) exists from sm90 on.
    tma_here = interp or _device_capability(a.device)[0] >= 9
    flags = dict(DOT_IN_FP32=interp, IEEE=(a.dtype == torch.float32 or interp), ACCUMULATE=accumulate is not None,
                 **pdl_flags(a))
    a_k_major = a.stride(1) == 1
    b_k_major = b.stride(0) == 1 and not b.stride(1) == 1
    a_desc = _descriptor(a, [bm, bk]) if a_k_major else _descriptor(a.t(), [bk, bm])
    b_desc = _descriptor(b.t(), [bn, bk]) if b_k_major else _descriptor(b, [bk, bn])
    c_desc = _descriptor(c, [bm, bn // 2] if accumulate is not None else [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    aligned = a_desc is not None and b_desc is not None and c_desc is not None
    if tma and not aligned:
        raise ValueError("matmul: tma=True needs 16-byte aligned, row-major operands")
    if tma and not tma_here:
        raise ValueError("matmul: tma=True needs a GPU of compute capability 9.0 or newer (TMA)")
    if aligned and tma_here and (tma or (tma is None and not interp)):
        programs = min(tiles, _num_sms(a.device.index or 0)) if cfg.persistent and not interp else tiles
        _matmul_tma_kernel[(programs,)](
            a_desc, b_desc, c_desc, m, n, k, programs, b, b.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
            A_K_MAJOR=a_k_major, B_K_MAJOR=b_k_major, **flags,
            WARP_SPECIALIZE=(cfg.persistent and k <= _WARP_SPECIALIZE_MAX_K and accumulate is None
                             and not interp),
            PREFETCH_K=_prefetch_k(m, k, b, b_k_major, flags["PDL"]),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return c
    _matmul_kernel[(tiles, 1)](
        a, b, c, m, n, k, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, EVEN_K=(k % bk == 0), **flags,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return c


def _prefetch_k(m: int, k: int, b: torch.Tensor, b_k_major: bool, pdl_on: bool) -> int:
    """How much of K the TMA kernel's programs prefetch of their weight rows before the PDL wait: a decode
    product's (up to `_PREFETCH_MAX_M` rows, bf16 weights read k-contiguous) under PDL; else 0."""
    if not pdl_on or not b_k_major or b.element_size() != 2 or m > _PREFETCH_MAX_M or min(k, _PREFETCH_K) < 64:
        return 0
    return 1 << (min(_PREFETCH_K, k).bit_length() - 1)


_NARROW = 32
"""A weight with a dimension this small (a LoRA adapter's rank) takes `matmul_split_k` for its gradient."""


def split_k_splits(m: int, n: int, k: int, device: torch.device | None = None) -> int:
    """How many K slices `matmul_split_k` cuts a narrow product into: enough programs to fill a GPU of PINNED_SMS
    twice over, slices of at least 1,024. A function of the shapes alone (so of the micro-batch's token count), not
    of the SMs this process sees: the slices' partial sums are the gradient's bits."""
    if interpreting():
        return max(1, min(4, k // 64))
    cfg = matmul_config(m, torch.bfloat16, device, n)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return max(1, min(2 * PINNED_SMS // tiles, k // 1024))


def matmul_split_k(a: torch.Tensor, b: torch.Tensor, accumulate: torch.Tensor) -> torch.Tensor:
    """accumulate += a[M, K] @ b[K, N] for a narrow product with a long K (a LoRA adapter's weight gradient:
    [r, tokens] @ [tokens, in] or [out, tokens] @ [tokens, r]), whose few output tiles would otherwise each
    walk all of K on one SM. K is cut into `split_k_splits` slices; each slice's product is an fp32 partial
    (its own chain of k-steps), the partials are summed over the slices by `torch.sum` (one fixed order for
    given shapes), then added to `accumulate`. Deterministic for given shapes, but not the bits of `matmul`'s
    single chain, and they follow K: for gradients only, never for a forward value that parity compares."""
    m, k = a.shape
    k2, n = b.shape
    if k != k2 or a.dtype != b.dtype or accumulate.dtype != torch.float32 or accumulate.shape != (m, n):
        raise ValueError(f"matmul_split_k: a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype} and "
                         f"accumulate {tuple(accumulate.shape)} {accumulate.dtype} (fp32 [M, N]) do not fit")
    splits = split_k_splits(m, n, k, a.device)
    if splits == 1 or m == 0 or n == 0:
        return matmul(a, b, accumulate=accumulate)
    cfg = matmul_config(m, a.dtype, a.device, n)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    parts = torch.empty((splits, m, n), device=a.device, dtype=torch.float32)
    interp = interpreting()
    _matmul_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), splits)](
        a, b, parts, m, n, k, k_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), parts.stride(1), parts.stride(2), parts.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, EVEN_K=(k % bk == 0),
        DOT_IN_FP32=interp, IEEE=(a.dtype == torch.float32 or interp), ACCUMULATE=False, **pdl_flags(a),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return accumulate.add_(parts.sum(0))


def _check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float("linear", "x", x)
    check_float("linear", "weight", weight)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        check_float("linear", "bias", bias)
        tensors["bias"] = bias
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"linear: `bias` must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same("linear", tensors)
    if weight.dim() != 2:
        raise ValueError(f"linear: `weight` must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: x's last dimension must equal weight's K = {weight.shape[1]}; "
            f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_device("linear", x)
        x2 = x.reshape(-1, x.shape[-1])
        if bias is None:
            y = matmul(x2, weight.t())
        else:
            y = (matmul(x2, weight.t(), out_dtype=torch.float32, tma=False) + bias.float()).to(x.dtype)
        ctx.save_for_backward(x2, weight)
        # The parameter object itself, for its `main_grad`: under activation checkpointing the saved `weight`
        # comes back from the recomputation as another tensor object, without the attribute, and dW would
        # silently take the bf16 path.
        ctx.param = weight
        ctx.x_shape = x.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = matmul(dy2, weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            main_grad = getattr(ctx.param, "main_grad", None)
            if main_grad is None:
                dw = matmul(dy2.t(), x2, out_dtype=weight.dtype)
            elif min(weight.shape) <= _NARROW:  # a LoRA adapter: [r, in] or [out, r]
                matmul_split_k(dy2.t(), x2, main_grad)
            else:
                matmul(dy2.t(), x2, accumulate=main_grad)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_linear(x, weight, bias)
    return LinearFn.apply(x, weight, bias)


def linear_standard(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """cuBLAS (or the CPU BLAS): tiling and split-K chosen per shape, so rows depend on M."""
    _check_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] @ weight[N, K].T (+ bias[N]) -> [..., N], by the kernel the mode picks for `linear`."""
    if get_mode("linear") == "standard":
        return linear_standard(x, weight, bias)
    return linear_invariant(x, weight, bias)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 reference."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()

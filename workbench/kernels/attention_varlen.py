"""Causal attention over sequences packed end to end without padding (FlashAttention's "varlen" layout): the
trainer's forward and backward over a micro-batch cut by real tokens.

Layout: q [N, Hq, D], k, v [N, Hkv, D]: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (cu_seqlens [S+1] int32,
rising from 0 to N), its row i at position i of that sequence; causal within each sequence, no key of another
sequence seen. max_len bounds the sequences' lengths (the launch grid).

Numerics contract (mode `invariant`): `attention.py`'s training kernel, per sequence. A sequence's rows are read
through its base pointer (row cu_seqlens[b]) and otherwise run the same code: the forward is `_kv_loop` (KV tiles of
the sequence's positions [j * BLOCK_N, (j + 1) * BLOCK_N), increasing j, `_tile_step`), the backward `_dkdv_tiles`
and `_dq_tiles`, with `attention_config` and `attention_bwd_config`, and delta is the padded kernel's own
(`_attn_bwd_delta_kernel` over the N rows as one sequence: a row-wise sum). A row's operands and their order are
the padded kernel's, so every output row, and every row of dQ, dK, dV, is the bits `attention` gives that sequence
in a right-padded batch, whatever the other sequences, their order or the packing. Programs: (query or key block,
sequence x head) with the block fastest on grid axis 0, as the padded kernels; a block past its sequence's length
returns at once. cu_seqlens is clamped to [0, N] on the GPU (nothing is read on the host) and checked, with an
error, for CPU tensors.

`standard` mode: PyTorch's FlashAttention-2 varlen (`aten._flash_attention_forward` with cu_seqlens, and its
backward) where it runs (a GPU of sm80 or newer, bf16/fp16, head_dim a multiple of 8 up to 256), else each
sequence padded to max_len through `attention.attention_standard`; both differentiable, neither bitwise the
invariant kernel (the negative control).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention import (
    _LOG2E,
    _attn_bwd_delta_kernel,
    _dkdv_tiles,
    _dq_tiles,
    _kv_loop,
    attention_bwd_config,
    attention_config,
    attention_reference,
    attention_standard,
)
from .mode import get_mode
from .runtime import check_device, check_float, check_same, interpreting, pdl_enter, pdl_flags


@triton.jit
def _program(cu_ptr, n_blocks, n_heads, n_tokens):
    # This program's (block, head, its sequence's first row, that sequence's length): programs are numbered
    # (block, sequence x head) with the block fastest on grid axis 0, as the padded kernels'. The bounds are clamped
    # to the N rows, so a bad cu_seqlens never reads past them.
    pid = tl.program_id(0) % n_blocks
    bh = tl.program_id(0) // n_blocks
    b = bh // n_heads
    first = tl.minimum(tl.maximum(tl.load(cu_ptr + b), 0), n_tokens)
    end = tl.minimum(tl.maximum(tl.load(cu_ptr + b + 1), first), n_tokens)
    return pid, bh % n_heads, first.to(tl.int64), (end - first).to(tl.int32)


@triton.jit
def _varlen_fwd_kernel(
    Q, K, V, Out, LSE, cu_ptr,
    sqt, sqh, skt, skh, svt, svh, sot, soh,
    n_q_heads, group, n_tokens, n_m, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr, PDL: tl.constexpr,
):
    # `_attn_fwd_kernel` with q_start 0 and kv_len the sequence's length, every address moved by its first row:
    # `_kv_loop` takes that row as its "batch" index with the token stride as the batch stride.
    pdl_enter(PDL)
    pid_m, h, first, seq_len = _program(cu_ptr, n_m, n_q_heads, n_tokens)
    kvh = h // group
    if pid_m * BLOCK_M < seq_len:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        real = offs_m[:, None] < seq_len
        q = tl.load(Q + (first + offs_m)[:, None] * sqt + h * sqh + offs_d[None, :], mask=real, other=0.0)
        hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
        m_i, l_i, acc = _kv_loop(q, K, V, first, kvh, skt, skt, skh, svt, svt, svh, offs_m, seq_len, hi, qk_scale,
                                 BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + (first + offs_m)[:, None] * sot + h * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=real)
        tl.store(LSE + h.to(tl.int64) * n_tokens + first + offs_m, m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)),
                 mask=offs_m < seq_len)


@triton.jit
def _varlen_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, cu_ptr,
    sqt, sqh, skt, skh, n_kv_heads, group, n_tokens, n_n, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PDL: tl.constexpr,
):
    # `_attn_bwd_dkdv_kernel` per sequence: q, dO share q's strides; k, v, dK, dV share k's; lse and delta are
    # [Hq, N]. dK, dV start as zeros (the launcher's), so rows of no sequence keep them.
    pdl_enter(PDL)
    pid_n, kvh, first, seq_len = _program(cu_ptr, n_n, n_kv_heads, n_tokens)
    if pid_n * BLOCK_N < seq_len:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        nmask = offs_n < seq_len
        kv_off = (first + offs_n)[:, None] * skt + kvh * skh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_tiles(Q, DO, LSE, DELTA, first * sqt, sqt, sqh, first, n_tokens, k, v, kvh, group, offs_n,
                             nmask, lo, seq_len, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
        tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=nmask[:, None])
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=nmask[:, None])


@triton.jit
def _varlen_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, cu_ptr,
    sqt, sqh, skt, skh, n_q_heads, group, n_tokens, n_m, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, PDL: tl.constexpr,
):
    # `_attn_bwd_dq_kernel` per sequence.
    pdl_enter(PDL)
    pid_m, h, first, seq_len = _program(cu_ptr, n_m, n_q_heads, n_tokens)
    kvh = h // group
    if pid_m * BLOCK_M < seq_len:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        mmask = offs_m < seq_len
        q_off = (first + offs_m)[:, None] * sqt + h * sqh + offs_d[None, :]
        q = tl.load(Q + q_off, mask=mmask[:, None], other=0.0)
        do = tl.load(DO + q_off, mask=mmask[:, None], other=0.0)
        row_base = h.to(tl.int64) * n_tokens + first
        lse = tl.load(LSE + row_base + offs_m, mask=mmask, other=0.0)
        delta = tl.load(DELTA + row_base + offs_m, mask=mmask, other=0.0)
        hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
        dq = _dq_tiles(q, do, lse, delta, K, V, first * skt, skt, skh, kvh, offs_m, mmask, seq_len, hi, qk_scale,
                       BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
        tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mmask[:, None])


def _check_varlen(q, k, v, cu_seqlens, max_len) -> None:
    op = "attention_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t)
        if t.dim() != 3:
            raise ValueError(f"{op}: `{name}` must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: `{name}` must be contiguous in head_dim (stride 1); call .contiguous() on it")
    check_same(op, {"q": q, "k": k, "v": v})
    n, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"{op}: k and v must be [{n}, Hkv, {d}] and equal, Hkv dividing the {hq} query heads; "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"{op}: head_dim must be a power of two >= 16, got {d}")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1
            or cu_seqlens.numel() == 0 or cu_seqlens.device != q.device):
        raise ValueError(f"{op}: `cu_seqlens` must be a 1-D int32 tensor [sequences + 1] on {q.device}")
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"{op}: `max_len` must be an int >= 0 (the longest sequence), got {max_len!r}")
    if q.device.type == "cpu":
        # Free on the CPU; on the GPU the kernels clamp instead, to stay sync-free.
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n or (lens.numel() and (int(lens.min()) < 0
                                                                                       or int(lens.max()) > max_len)):
            raise ValueError(f"{op}: cu_seqlens must rise from 0 to the {n} rows, in steps of at most max_len "
                             f"({max_len}); got {cu_seqlens.tolist()[:8]}")


def _consts(q, cfg) -> dict:
    return dict(BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HEAD_DIM=q.shape[2], IEEE=q.dtype == torch.float32,
                DOT_IN_FP32=interpreting(), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_flags(q))


def _forward(q, k, v, cu_seqlens, max_len):
    n, hq, d = q.shape
    hkv, s = k.shape[1], cu_seqlens.numel() - 1
    cfg = attention_config(d)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.zeros((hq, n), device=q.device, dtype=torch.float32)
    if n and s and max_len:
        n_m = triton.cdiv(max_len, cfg["block_m"])
        _varlen_fwd_kernel[(n_m * s * hq,)](
            q, k, v, out, lse, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), hq, hq // hkv, n, n_m, _LOG2E / math.sqrt(d),
            **_consts(q, cfg))
    return out, lse


def _backward(q, k, v, out, lse, cu_seqlens, max_len, dout):
    n, hq, d = q.shape
    hkv, s = k.shape[1], cu_seqlens.numel() - 1
    cfg = attention_bwd_config(d)
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if not (n and s and max_len):
        return dq, dk, dv
    delta = torch.empty((hq, n), device=q.device, dtype=torch.float32)
    qk_scale, sm_scale = _LOG2E / math.sqrt(d), 1.0 / math.sqrt(d)
    # delta is row-wise: the padded kernel over the N rows as one sequence ([1, N, Hq, D]) gives each row its bits.
    _attn_bwd_delta_kernel[(triton.cdiv(n, 64) * hq,)](
        out, dout, delta, out.stride(0), out.stride(1), hq, n, BLOCK_M=64, HEAD_DIM=d, **pdl_flags(q))
    c = cfg["dkdv"]
    n_n = triton.cdiv(max_len, c["block_n"])
    _varlen_bwd_dkdv_kernel[(n_n * s * hkv,)](
        q, k, v, dout, lse, delta, dk, dv, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        hkv, hq // hkv, n, n_n, qk_scale, sm_scale, **_consts(q, c))
    c = cfg["dq"]
    n_m = triton.cdiv(max_len, c["block_m"])
    _varlen_bwd_dq_kernel[(n_m * s * hq,)](
        q, k, v, dout, lse, delta, dq, cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        hq, hq // hkv, n, n_m, qk_scale, sm_scale, **_consts(q, c))
    return dq, dk, dv


class AttentionVarlenFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len):
        check_device("attention_varlen", q)
        out, lse = _forward(q, k, v, cu_seqlens, max_len)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        return (*_backward(q, k, v, out, lse, cu_seqlens, ctx.max_len, dout), None, None)


def attention_varlen_invariant(q, k, v, cu_seqlens, max_len: int):
    _check_varlen(q, k, v, cu_seqlens, max_len)
    return AttentionVarlenFn.apply(q, k, v, cu_seqlens, max_len)


def _flash_ok(q) -> bool:
    """FlashAttention-2's limits (`attention._flash_decode_ok`'s, any number of queries)."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _padded(q, k, v, cu_seqlens, max_len: int):
    """Each sequence right-padded to max_len ([S, max_len, H, D]) through `attention_standard`, the rows gathered
    back: the CPU's (and old GPUs') standard path."""
    n = q.shape[0]
    out = q.new_zeros(q.shape)
    if not (n and max_len and cu_seqlens.numel() > 1):
        return out
    first = cu_seqlens[:-1].long()
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    i = torch.arange(max_len, device=q.device)
    real = i[None, :] < lens[:, None]                                        # [S, max_len]
    rows = (first[:, None] + i).clamp(max=n - 1)                             # [S, max_len]
    o = attention_standard(q[rows], k[rows], v[rows], lens.to(torch.int32))  # [S, max_len, Hq, D]
    return out.index_put((rows[real],), o[real])


def attention_varlen_standard(q, k, v, cu_seqlens, max_len: int):
    """PyTorch's FlashAttention-2 varlen where it runs, else SDPA on each sequence padded to max_len."""
    _check_varlen(q, k, v, cu_seqlens, max_len)
    if _flash_ok(q) and q.shape[0] and max_len:
        # Differentiable: autograd's formula for it is FlashAttention-2's varlen backward.
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
                                                       False)[0]
    return _padded(q, k, v, cu_seqlens, max_len)


def attention_varlen(q, k, v, cu_seqlens, max_len: int):
    """Causal attention of each sequence of a packed batch (rows cu_seqlens[b]:cu_seqlens[b+1]), by the kernel the
    mode of `attention` picks; in `invariant` mode each row, and its gradients, are `attention`'s bits for that
    sequence in a padded batch."""
    if get_mode("attention") == "standard":
        return attention_varlen_standard(q, k, v, cu_seqlens, max_len)
    return attention_varlen_invariant(q, k, v, cu_seqlens, max_len)


def attention_varlen_reference(q, k, v, cu_seqlens, max_len: int):
    """fp64 reference: each sequence by `attention.attention_reference`."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if hi > lo:
            out[lo:hi] = attention_reference(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi])[0]
    return out

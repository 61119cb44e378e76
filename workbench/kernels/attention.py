"""Causal attention with GQA: the training forward and backward over a padded
batch, and the same forward against a static KV cache (prefill, decode). The
paged cache's forward (vLLM's layout) is `attention_paged.py`, on the same tiles.

Layouts: q [B, T, Hq, D]; k, v [B, S, Hkv, D] (Hq a multiple of Hkv; D a
power of two). A query at row i of sequence b sits at absolute position
q_start[b] + i and may see the keys at positions j <= its position with
j < kv_len[b]. Training is q_start = 0, kv_len = seq_len, k and v the sequence
itself; a cached step is the same kernel reading the cache, after the step's
K/V were written into it.

Numerics contract (mode `invariant`):
- s = dot(q, k^T) (bf16 operands on the tensor cores, fp32 accumulation over D),
  then s * (softmax_scale * log2 e) in fp32; online softmax in base 2:
  m' = max(m, rowmax(s)), p = exp2(s - m'), l = l * exp2(m - m') + rowsum(p),
  acc = acc * exp2(m - m') + dot(bf16(p), v) (fp32 accumulation);
  out = acc / l, cast once. Rounding points: bf16(p) and the final cast.
- KV tiles cover absolute positions [j * BLOCK_N, (j + 1) * BLOCK_N), taken in
  increasing j, with one (BLOCK_M, BLOCK_N, num_warps) for training, prefill and
  decode: a decode step is the same arithmetic with one query (`_attn_decode_kernel`
  puts the query heads of a KV head in the rows of one tile, so the group reads
  each K/V tile once; a row's bits do not depend on its place in the tile). Tiles past
  a row's position are fully masked for it and change nothing (alpha = 1, p = 0),
  so a query at position t gets the same bits in a training forward, a prefill
  or a decode step, whatever the batch, the other sequences or the padding.
- Paged (`attention_paged.py`): the same tiles of absolute positions, each key
  gathered from its page; the tile arithmetic is one shared function (`_tile_step`).
- No split-KV, no atomics. Masked K/V loads return 0, so stale cache memory can
  never bring a NaN in. Lengths are clamped to the buffers on the GPU (and
  checked, with an error, for CPU tensors). Padding queries (position >= kv_len) give zeros and
  pass no gradient.
- Backward (training only): FlashAttention-2 style, recomputing p from the
  saved base-2 log-sum-exp; delta = rowsum(dO * O) in fp32 read once from the
  bf16 tensors; dK and dV accumulate over query blocks, and over the query
  heads of a KV head, in a fixed order in registers; dQ in a second pass.
  Deterministic run to run. The backward has its own tiles
  (`attention_bwd_config`): they fix the order of dK/dV/dQ's sums, never a
  forward bit, so they are chosen for speed alone.
- Every product is the matmul's `dot_step`: `tl.dot` on the GPU; in the
  interpreter (CPU) fp32 products summed in a fixed order, never numpy's BLAS,
  whose rounding of a row may follow the row's place in the tile (a decode
  query sits at row 0, the same query of a training forward at its position
  mod BLOCK_M).
- Launch: each kernel's programs, (query or key block, sequence x head) with
  the block fastest, lie on grid axis 0 alone (2^31 - 1 programs): axes 1 and 2
  stop at 65,535, which 1,024 sequences of 64 heads would pass. Where a
  program sits changes which one computes a tile, never how.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .runtime import check_device, check_float, check_same, interpreting, pdl_enter, pdl_flags
from .matmul import dot_step
from .mode import get_mode

_LOG2E = math.log2(math.e)


@triton.jit
def _tile_step(q, k, v, m_i, l_i, acc, offs_n, q_pos, kmask, qk_scale,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    # One KV tile of the online softmax: the only arithmetic of every forward kernel here (training,
    # static cache, paged cache), so a query's bits depend on its row and the tiles, not on the caller.
    s = dot_step(q, k, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_IN_FP32, IEEE) * qk_scale
    s = tl.where((offs_n[None, :] <= q_pos[:, None]) & kmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no visible key yet keeps m = -inf: shift by 0 there.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot_step(p.to(v.dtype), v, acc * alpha[:, None], DOT_IN_FP32, IEEE)
    return m_new, l_i, acc


@triton.jit
def _kv_loop(q, K, V, b, kvh, skb, sks, skh, svb, svs, svh, q_pos, kv_len, hi, qk_scale,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
             DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    # The KV tiles [0, hi) of one KV head in increasing order, from an empty softmax state: shared by the
    # training/prefill kernel and the decode kernel, so a query's chain is one piece of code.
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kmask = offs_n < kv_len
        k = tl.load(K + b * skb + offs_n[None, :] * sks + kvh * skh + offs_d[:, None], mask=kmask[None, :], other=0.0)
        v = tl.load(V + b * svb + offs_n[:, None] * svs + kvh * svh + offs_d[None, :], mask=kmask[:, None], other=0.0)
        m_i, l_i, acc = _tile_step(q, k, v, m_i, l_i, acc, offs_n, q_pos, kmask, qk_scale,
                                   BLOCK_M, BLOCK_N, DOT_IN_FP32, IEEE)
    return m_i, l_i, acc


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, LSE, q_start_ptr, kv_len_ptr,
    sqb, sqt, sqh, skb, sks, skh, svb, svs, svh, sob, sot, soh,
    n_q_heads, T_q, S_kv, group, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr, STORE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (query block, sequence x head), numbered with the block fastest on grid axis 0
    # (axes 1 and 2 stop at 65,535 programs: 1,024 sequences of 64 heads would not launch there).
    pdl_enter(PDL)
    n_m = tl.cdiv(T_q, BLOCK_M)
    pid_m = tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kvh = h // group
    # Lengths are clamped to the buffers (the host checks them only for CPU tensors, to stay sync-free).
    q_start = tl.maximum(tl.load(q_start_ptr + b), 0)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S_kv)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = q_start + offs_m
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + offs_m[:, None] * sqt + h * sqh + offs_d[None, :],
                mask=offs_m[:, None] < T_q, other=0.0)
    # Keys past the block's last position are masked for every row of the block.
    hi = tl.minimum(kv_len, q_start + (pid_m + 1) * BLOCK_M)
    m_i, l_i, acc = _kv_loop(q, K, V, b, kvh, skb, sks, skh, svb, svs, svh, q_pos, kv_len, hi, qk_scale,
                             BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    # A query at a position >= kv_len is padding: zeros.
    out = tl.where(q_pos[:, None] < kv_len, out, 0.0)
    tl.store(Out + b * sob + offs_m[:, None] * sot + h * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=offs_m[:, None] < T_q)
    if STORE_LSE:
        tl.store(LSE + bh.to(tl.int64) * T_q + offs_m, m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)),
                 mask=offs_m < T_q)


@triton.jit
def _attn_decode_kernel(
    Q, K, V, Out, q_start_ptr, kv_len_ptr,
    sqb, sqh, skb, sks, skh, svb, svs, svh, sob, soh,
    n_kv_heads, S_kv, group, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # A decode step (one query per sequence): one program per (sequence, KV head), the group's query heads as
    # the rows of one tile, so each K/V tile is read once for the group instead of once per query head. Each
    # row's arithmetic is `_attn_fwd_kernel`'s for that query (the same tiles, `_tile_step`, config): only the
    # rows' places in the tile differ, which no row's bits depend on.
    pdl_enter(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    kvh = bh % n_kv_heads
    q_start = tl.maximum(tl.load(q_start_ptr + b), 0)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S_kv)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * group + rows
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + head[:, None] * sqh + offs_d[None, :], mask=rows[:, None] < group, other=0.0)
    q_pos = q_start + tl.zeros((BLOCK_M,), tl.int32)
    hi = tl.minimum(kv_len, q_start + BLOCK_M)   # `_attn_fwd_kernel`'s bound for a query block at q_start
    m_i, l_i, acc = _kv_loop(q, K, V, b, kvh, skb, sks, skh, svb, svs, svh, q_pos, kv_len, hi, qk_scale,
                             BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out = tl.where(q_pos[:, None] < kv_len, out, 0.0)
    tl.store(Out + b * sob + head[:, None] * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < group)


@triton.jit
def _attn_bwd_delta_kernel(O, DO, DELTA, sot, soh, n_q_heads, T, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PDL: tl.constexpr):
    # delta[(b, h), t] = sum_d dO * O, upcast to fp32 in registers: one read of each bf16 tensor (O and dO are
    # contiguous [B, T, Hq, D], so they share strides). One program per (query block, sequence x head).
    pdl_enter(PDL)
    n_m = tl.cdiv(T, BLOCK_M)
    pid_m = tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    off = b * T * sot + offs_m[:, None] * sot + h * soh + offs_d[None, :]
    mmask = offs_m[:, None] < T
    o = tl.load(O + off, mask=mmask, other=0.0).to(tl.float32)
    do = tl.load(DO + off, mask=mmask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, axis=1), mask=offs_m < T)


@triton.jit
def _dkdv_tiles(Q, DO, LSE, DELTA, q_base, sqt, sqh, lse_base, lse_sh, k, v, kvh, group, offs_n, nmask, lo, seq_len,
                qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    # dK, dV (fp32, dK unscaled) of one key block of one sequence: over the query heads of its KV head, then the
    # query blocks from `lo` up, in that fixed order. The sequence's query row i sits at Q + q_base + i * sqt (+ the
    # head), its lse and delta at lse_base + h * lse_sh + i: shared by the padded and the varlen kernels
    # (`attention_varlen.py`), so both sum a key's gradient in one order.
    offs_d = tl.arange(0, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    for g in range(0, group):
        h = kvh * group + g
        row_base = lse_base + h * lse_sh
        for start_m in range(lo, seq_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            mmask = offs_m < seq_len
            q_off = q_base + offs_m[:, None] * sqt + h * sqh + offs_d[None, :]
            q = tl.load(Q + q_off, mask=mmask[:, None], other=0.0)
            do = tl.load(DO + q_off, mask=mmask[:, None], other=0.0)
            lse = tl.load(LSE + row_base + offs_m, mask=mmask, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=mmask, other=0.0)
            s_t = dot_step(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT_IN_FP32, IEEE) * qk_scale
            valid = (offs_m[None, :] >= offs_n[:, None]) & mmask[None, :] & nmask[:, None]
            p_t = tl.where(valid, tl.exp2(s_t - lse[None, :]), 0.0)
            dv = dot_step(p_t.to(do.dtype), do, dv, DOT_IN_FP32, IEEE)
            dp_t = dot_step(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), DOT_IN_FP32, IEEE)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = dot_step(ds_t.to(q.dtype), q, dk, DOT_IN_FP32, IEEE)
    return dk, dv


@triton.jit
def _dq_tiles(q, do, lse, delta, K, V, kv_base, sks, skh, kvh, offs_m, mmask, seq_len, hi, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    # dQ (fp32, unscaled) of one query block of one sequence over its key tiles [0, hi) in increasing order, key j
    # at K + kv_base + j * sks (+ the head): shared by the padded and the varlen kernels.
    offs_d = tl.arange(0, HEAD_DIM)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < seq_len
        kv_off = kv_base + offs_n[:, None] * sks + kvh * skh + offs_d[None, :]
        k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
        s = dot_step(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_IN_FP32, IEEE) * qk_scale
        valid = (offs_n[None, :] <= offs_m[:, None]) & nmask[None, :] & mmask[:, None]
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = dot_step(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), DOT_IN_FP32, IEEE)
        ds = p * (dp - delta[:, None])
        dq = dot_step(ds.to(k.dtype), k, dq, DOT_IN_FP32, IEEE)
    return dq


@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, len_ptr,
    sqb, sqt, sqh, skb, sks, skh, n_q_heads, n_kv_heads, T, group, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # q, dO share q's strides; k, v, dK, dV share k's (all made contiguous by the launcher).
    # One program per (key block, sequence x KV head), the block fastest, all on grid axis 0.
    pdl_enter(PDL)
    n_n = tl.cdiv(T, BLOCK_N)
    pid_n = tl.program_id(0) % n_n
    bhk = tl.program_id(0) // n_n
    b = (bhk // n_kv_heads).to(tl.int64)
    kvh = bhk % n_kv_heads
    seq_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    nmask = offs_n < seq_len
    kv_off = b * skb + offs_n[:, None] * sks + kvh * skh + offs_d[None, :]
    k = tl.load(K + kv_off, mask=nmask[:, None], other=0.0)
    v = tl.load(V + kv_off, mask=nmask[:, None], other=0.0)
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    dk, dv = _dkdv_tiles(Q, DO, LSE, DELTA, b * sqb, sqt, sqh, b * n_q_heads * T, T, k, v, kvh, group, offs_n, nmask,
                         lo, seq_len, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
    # Padding rows (past seq_len, up to T) get exact zeros.
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)


@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, len_ptr,
    sqb, sqt, sqh, skb, sks, skh, n_q_heads, T, group, qk_scale, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per (query block, sequence x head), the block fastest, all on grid axis 0.
    pdl_enter(PDL)
    n_m = tl.cdiv(T, BLOCK_M)
    pid_m = tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kvh = h // group
    seq_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), T)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mmask = offs_m < seq_len
    q_off = b * sqb + offs_m[:, None] * sqt + h * sqh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=mmask[:, None], other=0.0)
    do = tl.load(DO + q_off, mask=mmask[:, None], other=0.0)
    row_base = bh.to(tl.int64) * T
    lse = tl.load(LSE + row_base + offs_m, mask=mmask, other=0.0)
    delta = tl.load(DELTA + row_base + offs_m, mask=mmask, other=0.0)
    hi = tl.minimum(seq_len, (pid_m + 1) * BLOCK_M)
    dq = _dq_tiles(q, do, lse, delta, K, V, b * skb, sks, skh, kvh, offs_m, mmask, seq_len, hi, qk_scale,
                   BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


KV_TILE = 64
"""Keys per K/V tile of every forward kernel on the GPU, whatever the head dim: a paged cache with pages of a
multiple of it reads each tile from one page (`attention_paged`)."""


def attention_config(head_dim: int) -> dict:
    """One config for training, prefill and decode (a function of the head dim only). The decode kernels take
    their own pipeline depth (`decode_stages`): stages only decide how many K/V tiles are loaded ahead, never the
    arithmetic (3 stages were the fastest, the same bits: BENCHMARKS.md, "Numbers behind the code")."""
    if interpreting():
        # BLOCK_N 16 keeps the tests' short sequences crossing KV tiles; BLOCK_M 64 makes fewer programs (the
        # interpreter's cost is per program step) and moves no bit: a row's arithmetic does not see its tile.
        return {"block_m": 64, "block_n": 16, "num_warps": 4, "num_stages": 1, "decode_stages": 1}
    return {"block_m": 64, "block_n": KV_TILE, "num_warps": 4, "num_stages": 2 if head_dim > 64 else 3,
            "decode_stages": 3}


def attention_bwd_config(head_dim: int) -> dict:
    """The backward's tiles per kernel: dK/dV (one program per key block) and dQ (one per query block).

    GPU: the fastest of `tools/tune/tune_attention.py`'s candidates at 16 x 1,024 tokens (BENCHMARKS.md, "Numbers behind the code")."""
    if interpreting():
        # dK/dV sum over query blocks: BLOCK_M fixes that order, so it keeps the 16 its gradients always had.
        return {"dkdv": {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1},
                "dq": attention_config(head_dim)}
    if head_dim > 64:
        return {"dkdv": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3},
                "dq": attention_config(head_dim)}
    return {"dkdv": {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}, "dq": attention_config(head_dim)}


def tile_config() -> dict:
    return {f"head_dim_{d}": {"forward": attention_config(d), **attention_bwd_config(d)} for d in (128, 64)}


def _check(op: str, q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: `{name}` must be [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
    check_same(op, {"q": q, "k": k, "v": v})
    bq, _, hq, d = q.shape
    if k.shape[2] == 0:
        raise ValueError(f"{op}: k and v have no heads")
    if k.shape != v.shape or k.shape[0] != bq or k.shape[3] != d:
        raise ValueError(f"{op}: k and v must be [{bq}, S, Hkv, {d}] and equal; got {tuple(k.shape)}, {tuple(v.shape)}")
    if hq % k.shape[2]:
        raise ValueError(f"{op}: query heads ({hq}) must be a multiple of key/value heads ({k.shape[2]})")
    if d & (d - 1) or d < 16:
        raise ValueError(f"{op}: head_dim must be a power of two >= 16, got {d}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: `{name}` must be contiguous in head_dim (stride 1); call .contiguous() on it")


def _lengths(op: str, name: str, lens, batch: int, upper: int, device) -> torch.Tensor:
    if lens is None:
        return torch.full((batch,), upper, dtype=torch.int32, device=device)
    if not isinstance(lens, torch.Tensor) or lens.dtype not in (torch.int32, torch.int64) or lens.shape != (batch,):
        raise ValueError(f"{op}: `{name}` must be an int tensor of shape ({batch},)")
    if lens.device.type == "cpu" and lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > upper):
        raise ValueError(f"{op}: `{name}` must lie in [0, {upper}], got [{int(lens.min())}, {int(lens.max())}]")
    return lens.to(device=device, dtype=torch.int32)


def _forward(q, k, v, q_start, kv_len, store_lse: bool):
    b, t, hq, d = q.shape
    cfg = attention_config(d)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((b * hq, t), device=q.device, dtype=torch.float32) if store_lse else out
    hkv = k.shape[2]
    if b and t == 1 and not store_lse and 1 < hq // hkv <= cfg["block_m"]:
        _attn_decode_kernel[(b * hkv,)](
            q, k, v, out, q_start, kv_len,
            q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(2), hkv, k.shape[1], hq // hkv, _LOG2E / math.sqrt(d),
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HEAD_DIM=d,
            IEEE=q.dtype == torch.float32, DOT_IN_FP32=interpreting(),
            num_warps=cfg["num_warps"], num_stages=cfg["decode_stages"], **pdl_flags(q),
        )
    elif b and t:
        grid = (triton.cdiv(t, cfg["block_m"]) * b * hq,)
        _attn_fwd_kernel[grid](
            q, k, v, out, lse, q_start, kv_len,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            hq, t, k.shape[1], hq // k.shape[2], _LOG2E / math.sqrt(d),
            BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HEAD_DIM=d,
            IEEE=q.dtype == torch.float32, DOT_IN_FP32=interpreting(), STORE_LSE=store_lse,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_flags(q),
        )
    return out, lse


class AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_lens):
        check_device("attention", q)
        b, t = q.shape[:2]
        q_start = torch.zeros(b, dtype=torch.int32, device=q.device)
        out, lse = _forward(q, k, v, q_start, seq_lens, store_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, seq_lens)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seq_lens = ctx.saved_tensors
        return _backward(q, k, v, out, lse, seq_lens, dout)


def _backward(q, k, v, out, lse, seq_lens, dout):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    cfg = attention_bwd_config(d)
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty((b * hq, t), device=q.device, dtype=torch.float32)
    common = {"HEAD_DIM": d, "IEEE": q.dtype == torch.float32, "DOT_IN_FP32": interpreting(), **pdl_flags(q)}
    qk_scale, sm_scale = _LOG2E / math.sqrt(d), 1.0 / math.sqrt(d)
    if b and t:
        _attn_bwd_delta_kernel[(triton.cdiv(t, 64) * b * hq,)](
            out, dout, delta, out.stride(1), out.stride(2), hq, t, BLOCK_M=64, HEAD_DIM=d, **pdl_flags(q))
        c = cfg["dkdv"]
        _attn_bwd_dkdv_kernel[(triton.cdiv(t, c["block_n"]) * b * hkv,)](
            q, k, v, dout, lse, delta, dk, dv, seq_lens,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            hq, hkv, t, hq // hkv, qk_scale, sm_scale, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
            num_warps=c["num_warps"], num_stages=c["num_stages"], **common,
        )
        c = cfg["dq"]
        _attn_bwd_dq_kernel[(triton.cdiv(t, c["block_m"]) * b * hq,)](
            q, k, v, dout, lse, delta, dq, seq_lens,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            hq, t, hq // hkv, qk_scale, sm_scale, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
            num_warps=c["num_warps"], num_stages=c["num_stages"], **common,
        )
    return dq, dk, dv, None


def attention_invariant(q, k, v, seq_lens=None):
    _check("attention", q, k, v)
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"attention: q and k/v must have one sequence length, got {q.shape[1]} and {k.shape[1]}")
    lens = _lengths("attention", "seq_lens", seq_lens, q.shape[0], q.shape[1], q.device)
    return AttentionFn.apply(q, k, v, lens)


def _masks(q_start, kv_len, t_q: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, 1, Tq, S] key j visible to query i, [B, Tq, 1, 1] query i is not padding)."""
    pos = q_start.long()[:, None] + torch.arange(t_q, device=device)[None, :]
    keys = torch.arange(s, device=device)
    kv_len = kv_len.long()
    visible = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < kv_len[:, None, None])
    return visible[:, None], (pos < kv_len[:, None])[:, :, None, None]


def _sdpa(q, k, v, q_start, kv_len):
    """PyTorch SDPA on [B, T, H, D] tensors, with the invariant kernel's padding rule."""
    visible, real = _masks(q_start, kv_len, q.shape[1], k.shape[1], q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=visible, enable_gqa=q.shape[2] != k.shape[2])
    return (out.transpose(1, 2).nan_to_num(0.0) * real).to(q.dtype)


def _flash_decode_ok(q, k) -> bool:
    """Whether a standard decode step can take FlashAttention (`_flash_decode`): one query per sequence, a GPU of
    sm80 or newer, bf16/fp16, head_dim a multiple of 8 up to 256 (FlashAttention-2's limits)."""
    d = q.shape[-1]
    return (q.is_cuda and q.shape[1] == 1 and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0
            and d <= 256 and torch.cuda.get_device_capability(q.device)[0] >= 8 and k.stride(-1) == 1)


def _flash_decode(q, k_cache, v_cache, kv_len):
    """One query per sequence [B, 1, Hq, D] against its first kv_len[b] cached keys, by PyTorch's own
    FlashAttention-2 (its varlen forward): the static cache [B, S, Hkv, D] is read as S-key slots, of which
    `seqused_k` keeps each sequence's first kv_len. No mask is built and no key past kv_len is read (the masked
    SDPA call reads all S and falls back from flash attention). A KV head's Hq / Hkv query heads go in as that
    many query rows of one head (all at the last position, so no causal mask), so each K/V tile is read once for
    them: FlashAttention's own decode layout (`seqlenq_ngroups_swapped`), which its varlen entry does not do
    itself. The usual fast path: vLLM's decode is FlashAttention over its cache too."""
    b, _, hq, d = q.shape
    s, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    rows = q.reshape(b, hkv, g, d).transpose(1, 2).reshape(b * g, hkv, d)    # query head h = kv * g + i
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        rows, k_cache.reshape(b * s, hkv, d), v_cache.reshape(b * s, hkv, d), cu * g, cu * s, g, s, 0.0, False,
        False, seqused_k=kv_len.to(torch.int32))[0]
    return out.view(b, g, hkv, d).transpose(1, 2).reshape(b, 1, hq, d)


def attention_standard(q, k, v, seq_lens=None):
    """PyTorch SDPA's causal kernel (flash attention on the GPU), padding or not.

    Right padding needs no mask: a real query (position < seq_len) sees only keys at positions <= its own, all
    real, so the causal kernel gives it exactly what a masked one would. Padding queries are then zeroed, the
    invariant kernel's rule, which also stops their gradient; a masked SDPA call would fall back from flash
    attention to a slower kernel and materialise a [B, 1, T, T] mask.
    """
    _check("attention", q, k, v)
    b, t = q.shape[:2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    if seq_lens is None:
        return out
    lens = _lengths("attention", "seq_lens", seq_lens, b, t, q.device)
    padding = torch.arange(t, device=q.device)[None, :] >= lens[:, None]                # [B, T]
    return out.masked_fill(padding[:, :, None, None], 0.0)


def attention(q, k, v, seq_lens=None):
    """Causal self-attention over a right-padded batch [B, T, H, D], by the kernel the mode picks."""
    if get_mode("attention") == "standard":
        return attention_standard(q, k, v, seq_lens)
    return attention_invariant(q, k, v, seq_lens)


def attention_with_cache(q, k_cache, v_cache, q_start, kv_len):
    """Queries [B, Tq, Hq, D] at positions q_start[b] + i against the cache's first kv_len[b] keys.

    The step's own K/V must already be in the cache. Forward only (generation).
    """
    _check("attention_with_cache", q, k_cache, v_cache)
    b, t = q.shape[:2]
    s = k_cache.shape[1]
    q_start = _lengths("attention_with_cache", "q_start", q_start, b, s, q.device)
    kv_len = _lengths("attention_with_cache", "kv_len", kv_len, b, s, q.device)
    if get_mode("attention") == "standard":
        if _flash_decode_ok(q, k_cache):
            return _flash_decode(q, k_cache, v_cache, kv_len)
        return _sdpa(q, k_cache, v_cache, q_start, kv_len)
    check_device("attention_with_cache", q)
    return _forward(q, k_cache, v_cache, q_start, kv_len, store_lse=False)[0]


def attention_reference(q, k, v, seq_lens=None):
    """fp64 reference."""
    b, t, hq, d = q.shape
    lens = torch.full((b,), t) if seq_lens is None else seq_lens.cpu()
    visible, real = (m.to(q.device) for m in _masks(torch.zeros_like(lens), lens, t, t, "cpu"))
    rep = hq // k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd, vd = kd.repeat_interleave(rep, 1), vd.repeat_interleave(rep, 1)
    s = (qd @ kd.transpose(-1, -2)) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2) * real

"""Attention over a paged KV cache (vLLM's layout: a flattened batch, keys in pages through a block table), and
the write of a step's K/V into those pages. Forward only (generation).

Numerics contract (mode `invariant`): `attention.py`'s. A token's row is computed over the same tiles of absolute
key positions, in the same order, by the same `_tile_step` and the same (BLOCK_M, BLOCK_N, num_warps), each key
gathered from its page (any page size), so it gets the bits of the training forward and of
`attention_with_cache`, whatever the paging, the batch or the chunking. Pages of a multiple of the K/V tile
(`attention.KV_TILE`, what the vLLM backend asks for) let a tile read one block-table entry and contiguous keys.
A step of at most one token per sequence (`_paged_attn_decode_kernel`) puts a KV head's query heads in the rows
of one tile, as `_attn_decode_kernel` does; a row's bits do not depend on its place in the tile. Nothing reads a
tensor on the host on the GPU (lengths are clamped there, checked with an error for CPU tensors), so a step can be
captured in a CUDA graph: a padded request (no query row, kv_len 0, slot -1) reads and writes nothing. `standard`
mode gathers each sequence's keys and runs PyTorch SDPA (`_paged_sdpa`), which reads the longest length on the
host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, check_same, interpreting, pdl_enter, pdl_flags
from .attention import _LOG2E, _sdpa, _tile_step, attention_config
from .mode import get_mode


@triton.jit
def _paged_kv_loop(q, KP, VP, BT, b, kvh, sbt, skp, sks, skh, svp, svs, svh, q_pos, kv_len, hi, qk_scale,
                   PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                   DOT_IN_FP32: tl.constexpr, IEEE: tl.constexpr):
    # `_kv_loop` over paged keys: the same tiles of absolute positions, each key gathered from its page
    # BT[b, j // PAGE], slot j % PAGE. Shared by the paged prefill/chunk kernel and the paged decode kernel.
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kmask = offs_n < kv_len
        if PAGE % BLOCK_N == 0:
            # The tile lies in one page (start_n < kv_len, so its entry is the sequence's): one entry of the block
            # table, and the keys' addresses run on contiguously as the static cache's do, which the compiler can
            # pipeline and vectorize as it does there. The same keys are loaded either way.
            page = tl.load(BT + b * sbt + start_n // PAGE).to(tl.int64)
        else:
            page = tl.load(BT + b * sbt + offs_n // PAGE, mask=kmask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k = tl.load(KP + (page * skp + slot * sks)[None, :] + kvh * skh + offs_d[:, None],
                    mask=kmask[None, :], other=0.0)
        v = tl.load(VP + (page * svp + slot * svs)[:, None] + kvh * svh + offs_d[None, :],
                    mask=kmask[:, None], other=0.0)
        m_i, l_i, acc = _tile_step(q, k, v, m_i, l_i, acc, offs_n, q_pos, kmask, qk_scale,
                                   BLOCK_M, BLOCK_N, DOT_IN_FP32, IEEE)
    return l_i, acc


@triton.jit
def _paged_attn_fwd_kernel(
    Q, KP, VP, Out, cu_q_ptr, kv_len_ptr, BT,
    sqt, sqh, skp, sks, skh, svp, svs, svh, sot, soh, sbt,
    n_q_heads, group, max_kv, qk_scale, n_m,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # Sequence b's new tokens are rows cu_q[b]:cu_q[b+1] of Q, at the last positions of its kv_len keys.
    # Tiles, masks and `_tile_step` are the training kernel's, so a token gets its training-forward bits
    # whatever the paging. Programs as in the training kernel: n_m = cdiv(max_q, BLOCK_M) query blocks per
    # (sequence, head), the block fastest.
    pdl_enter(PDL)
    pid_m = tl.program_id(0) % n_m
    bh = tl.program_id(0) // n_m
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    kvh = h // group
    q_lo = tl.load(cu_q_ptr + b).to(tl.int64)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), max_kv)
    t_q = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1) - q_lo, 0), kv_len)
    q_start = kv_len - t_q
    if pid_m * BLOCK_M < t_q:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        q_pos = q_start + offs_m
        offs_d = tl.arange(0, HEAD_DIM)
        rows = q_lo + offs_m
        q = tl.load(Q + rows[:, None] * sqt + h * sqh + offs_d[None, :], mask=offs_m[:, None] < t_q, other=0.0)
        hi = tl.minimum(kv_len, q_start + (pid_m + 1) * BLOCK_M)
        l_i, acc = _paged_kv_loop(q, KP, VP, BT, b, kvh, sbt, skp, sks, skh, svp, svs, svh, q_pos, kv_len, hi,
                                  qk_scale, PAGE, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + rows[:, None] * sot + h * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=offs_m[:, None] < t_q)


@triton.jit
def _paged_attn_decode_kernel(
    Q, KP, VP, Out, cu_q_ptr, kv_len_ptr, BT,
    sqt, sqh, skp, sks, skh, svp, svs, svh, sot, soh, sbt,
    n_kv_heads, group, max_kv, qk_scale,
    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    # A step of at most one new token per sequence (vLLM's decode steps, padded requests with none): as
    # `_attn_decode_kernel`, one program per (sequence, KV head), the group's query heads as the rows of one
    # tile, each K/V tile gathered once for the group. Each row's arithmetic is `_paged_attn_fwd_kernel`'s for
    # that token (its bound hi = kv_len for a block holding the last position, the same tiles and config).
    pdl_enter(PDL)
    bh = tl.program_id(0)
    b = (bh // n_kv_heads).to(tl.int64)
    kvh = bh % n_kv_heads
    q_lo = tl.load(cu_q_ptr + b).to(tl.int64)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), max_kv)
    t_q = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1) - q_lo, 0), kv_len)
    if t_q > 0:
        rows = tl.arange(0, BLOCK_M)
        head = kvh * group + rows
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + q_lo * sqt + head[:, None] * sqh + offs_d[None, :], mask=rows[:, None] < group, other=0.0)
        q_pos = (kv_len - 1) + tl.zeros((BLOCK_M,), tl.int32)
        l_i, acc = _paged_kv_loop(q, KP, VP, BT, b, kvh, sbt, skp, sks, skh, svp, svs, svh, q_pos, kv_len, kv_len,
                                  qk_scale, PAGE, BLOCK_M, BLOCK_N, HEAD_DIM, DOT_IN_FP32, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + q_lo * sot + head[:, None] * soh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=rows[:, None] < group)


@triton.jit
def _paged_write_kernel(K, V, KP, VP, slots_ptr, skt, skh, svt, svh, skp, sks, skh2, svp, svs, svh2,
                        PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    # A copy, no arithmetic: token t's K/V (one head per program) into its slot; a negative slot is padding.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE
        off = slot % PAGE
        d = tl.arange(0, HEAD_DIM)
        tl.store(KP + page * skp + off * sks + h * skh2 + d, tl.load(K + t * skt + h * skh + d))
        tl.store(VP + page * svp + off * svs + h * svh2 + d, tl.load(V + t * svt + h * svh + d))


def _check_paged(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q: int) -> None:
    op = "attention_paged"
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        check_float(op, name, t)
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: `{name}` must be contiguous in head_dim (stride 1)")
    check_same(op, {"q": q, "k_pages": k_pages, "v_pages": v_pages})
    if q.dim() != 3 or k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"{op}: q must be [tokens, Hq, D] and k/v pages [pages, page_size, Hkv, D] (equal); "
                         f"got {tuple(q.shape)}, {tuple(k_pages.shape)}, {tuple(v_pages.shape)}")
    d = q.shape[2]
    if k_pages.shape[3] != d or q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"{op}: head_dim {d} and query heads {q.shape[1]} must match the pages' "
                         f"{k_pages.shape[3]} and be a multiple of their {k_pages.shape[2]} KV heads")
    if d & (d - 1) or d < 16:
        raise ValueError(f"{op}: head_dim must be a power of two >= 16, got {d}")
    if not isinstance(kv_len, torch.Tensor) or kv_len.dim() != 1:
        raise ValueError(f"{op}: `kv_len` must be a 1-D int tensor (keys per sequence)")
    s = kv_len.shape[0]
    width = block_table.shape[-1] if isinstance(block_table, torch.Tensor) else -1
    for name, t, shape in (("kv_len", kv_len, (s,)), ("cu_q", cu_q, (s + 1,)),
                           ("block_table", block_table, (s, width))):
        if (not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != shape
                or t.device != q.device or t.stride(-1) != 1):
            raise ValueError(f"{op}: `{name}` must be an int tensor of shape {shape} on {q.device}, "
                             "contiguous in its last dimension")
    if q.device.type == "cpu" and s:
        # Free on the CPU; on the GPU the kernel clamps instead, to stay sync-free.
        q_len = cu_q[1:] - cu_q[:-1]
        if (int(cu_q[0]) != 0 or int(q_len.min()) < 0 or int(cu_q[-1]) > q.shape[0] or int(q_len.max()) > max_q
                or bool((q_len > kv_len).any()) or int(kv_len.max()) > width * k_pages.shape[1]):
            raise ValueError(f"{op}: cu_q must rise from 0 to at most {q.shape[0]} rows in steps of at most max_q "
                             f"({max_q}), each sequence's new tokens at most its kv_len, and kv_len at most its "
                             f"block-table row's {width} pages of {k_pages.shape[1]}")


def attention_paged(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q: int):
    """Causal attention of a flattened batch against paged keys/values (vLLM's layout). Forward only.

    q [N, Hq, D]: sequence b's new tokens are rows cu_q[b]:cu_q[b+1], at the last positions of its
    kv_len[b] keys; k_pages, v_pages [P, page_size, Hkv, D] (any strides, head_dim contiguous) hold
    key j of sequence b in page block_table[b, j // page_size], slot j % page_size. The step's own
    K/V must already be there (`paged_kv_write`). max_q bounds cu_q's differences (the launch grid).
    In `invariant` mode a token gets the bits of the training forward and of `attention_with_cache`.
    Rows of q past cu_q[-1] are left as zeros.
    """
    _check_paged(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    n_seq, page = kv_len.shape[0], k_pages.shape[1]
    if get_mode("attention") == "standard":
        return _paged_sdpa(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q, out)
    check_device("attention_paged", q)
    d = q.shape[2]
    cfg = attention_config(d)
    hq, hkv = q.shape[1], k_pages.shape[2]
    args = (q, k_pages, v_pages, out, cu_q, kv_len, block_table,
            q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2), out.stride(0), out.stride(1),
            block_table.stride(0))
    consts = dict(**pdl_flags(q), PAGE=page, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], HEAD_DIM=d,
                  IEEE=q.dtype == torch.float32, DOT_IN_FP32=interpreting(), num_warps=cfg["num_warps"])
    if n_seq and max_q == 1 and 1 < hq // hkv <= cfg["block_m"]:
        _paged_attn_decode_kernel[(n_seq * hkv,)](*args, hkv, hq // hkv, block_table.shape[1] * page,
                                                 _LOG2E / math.sqrt(d), num_stages=cfg["decode_stages"], **consts)
    elif n_seq and max_q > 0:
        n_m = triton.cdiv(max_q, cfg["block_m"])
        _paged_attn_fwd_kernel[(n_m * n_seq * hq,)](*args, hq, hq // hkv, block_table.shape[1] * page,
                                                   _LOG2E / math.sqrt(d), n_m, num_stages=cfg["num_stages"],
                                                   **consts)
    return out


def paged_kv_write(k, v, k_pages, v_pages, slots) -> None:
    """Copy token t's k[t], v[t] [Hkv, D] into slot slots[t] (page slots // page_size) of the pages.

    Only the first len(slots) tokens are written; a negative slot (padding) is skipped. A copy,
    the same in both modes.
    """
    op = "paged_kv_write"
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: `slots` must be a 1-D int tensor (page * page_size + slot per token)")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if t.dim() != 4 or t.stride(-1) != 1 or t.device != k.device or slots.device != k.device:
            raise ValueError(f"{op}: `{name}` must be [pages, page_size, Hkv, D], contiguous in D, on {k.device} "
                             "like `k` and `slots`")
    if slots.device.type == "cpu" and slots.numel() and int(slots.max()) >= k_pages.shape[0] * k_pages.shape[1]:
        raise ValueError(f"{op}: a slot ({int(slots.max())}) lies past the {k_pages.shape[0]} pages of "
                         f"{k_pages.shape[1]}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[1:] != k_pages.shape[2:] or t.shape[0] < slots.shape[0]:
            raise ValueError(f"{op}: `{name}` must be [>= {slots.shape[0]} tokens, {k_pages.shape[2]}, "
                             f"{k_pages.shape[3]}], got {tuple(t.shape)}")
    if k_pages.shape != v_pages.shape or k_pages.dtype != k.dtype or v_pages.dtype != v.dtype:
        raise ValueError(f"{op}: pages must match each other and the keys' dtype")
    k, v = k.contiguous(), v.contiguous()
    if slots.shape[0] == 0:
        return
    if k.device.type != "cuda" and not interpreting():
        paged_kv_write_reference(k, v, k_pages, v_pages, slots)
        return
    _paged_write_kernel[(slots.shape[0], k.shape[1])](
        k, v, k_pages, v_pages, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), v_pages.stride(0), v_pages.stride(1),
        v_pages.stride(2), PAGE=k_pages.shape[1], HEAD_DIM=k.shape[2], **pdl_flags(k),
    )


def _paged_sdpa(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q, out):
    """Standard mode: gather each sequence's keys into a padded batch and run PyTorch SDPA."""
    page = k_pages.shape[1]
    n_seq = kv_len.shape[0]
    if n_seq == 0 or max_q <= 0 or q.shape[0] == 0:
        return out
    kv_len = kv_len.long()
    q_len = (cu_q[1:] - cu_q[:-1]).long()
    pos = torch.arange(max(int(kv_len.max()), 1), device=q.device)
    pages = block_table.long()[:, pos // page]                               # [S, L]
    # Slots past a sequence's keys may hold anything (NaN): zero them, as the kernel's masked loads do.
    seen = (pos[None, :] < kv_len[:, None])[:, :, None, None]                # [S, L, 1, 1]
    k = torch.where(seen, k_pages[pages, pos % page], 0.0)                   # [S, L, Hkv, D]
    v = torch.where(seen, v_pages[pages, pos % page], 0.0)
    i = torch.arange(max_q, device=q.device)
    real = i[None, :] < q_len[:, None]                                       # [S, Tq]
    rows = (cu_q[:-1].long()[:, None] + i).clamp(max=q.shape[0] - 1)         # [S, Tq]
    o = _sdpa(q[rows], k, v, (kv_len - q_len).to(torch.int32), kv_len.to(torch.int32))
    out[rows[real]] = o[real]
    return out


def attention_paged_reference(q, k_pages, v_pages, block_table, cu_q, kv_len, max_q: int):
    """fp64 reference of `attention_paged`: each sequence's keys gathered from its pages, then `attention`'s
    reference rule (query i of sequence b at position kv_len[b] - q_len[b] + i sees keys 0..that position).
    Rows of q past cu_q[-1] are zeros."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    page, rep = k_pages.shape[1], q.shape[1] // k_pages.shape[2]
    for b in range(kv_len.shape[0]):
        lo, hi, n = int(cu_q[b]), int(cu_q[b + 1]), int(kv_len[b])
        if hi == lo or n == 0:
            continue
        keys = torch.arange(n, device=q.device)
        slots = block_table[b].long()[keys // page], keys % page
        k = k_pages[slots].double().repeat_interleave(rep, 1)              # [n, Hq, D]
        v = v_pages[slots].double().repeat_interleave(rep, 1)
        pos = n - (hi - lo) + torch.arange(hi - lo, device=q.device)     # [Tq]
        s = torch.einsum("thd,jhd->htj", q[lo:hi].double(), k) / math.sqrt(q.shape[2])
        s = s.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("htj,jhd->thd", torch.softmax(s, -1), v)
    return out


def paged_kv_write_reference(k, v, k_pages, v_pages, slots) -> None:
    """The PyTorch form (a copy): k[t], v[t] into slot slots[t] of the pages, negative slots skipped."""
    keep = slots >= 0
    s = slots[keep].long()
    page = k_pages.shape[1]
    k_pages[s // page, s % page] = k[: slots.shape[0]][keep].to(k_pages.dtype)
    v_pages[s // page, s % page] = v[: slots.shape[0]][keep].to(v_pages.dtype)

"""`gumbel_argmax`: the sampler's draw, argmax over the vocabulary of logits / T + Gumbel noise, fused.

Numerics contract:
- The noise of vocabulary entry v in a row of request r at generation position p is a function
  of (seed, r, p, v) alone: a 32-bit integer hash (murmur3's finaliser, unsigned wrap-around
  arithmetic), u = ((bits >> 9) + 0.5) / 2^23, exact in fp32 and strictly inside (0, 1), and
  g = -log(-log(u)) in fp32.
  `uniforms` is the same hash in PyTorch (int64 masked to 32 bits),
  so u is the same bits there.
- score = fp32(logit) / T (IEEE division) + g; entries `keep` leaves out, and padding, are -inf. At T = 1 the
  division is left out: x / 1 is x in IEEE arithmetic (NaN and inf included), and at large batches the draw is
  bound by its arithmetic, not by the logits' bytes.
- The token is the first index of the row's maximum score. One program per (row, chunk of BLOCK_V
  columns) finds its chunk's maximum and first index of it; a second kernel takes the first chunk
  holding the row's maximum. A max is exact, so the token is the same whatever the chunks (one
  program a row looping over them, before, drew the same tokens): it depends on its row alone,
  never on the other rows or their number. The chunks spread a row's hashes and logs over the GPU,
  where one program a row left most SMs idle at decode batch sizes.
- The logits are read once and nothing of [rows, vocab] is written (the PyTorch form,
  `gumbel_argmax_reference`, makes about twenty int64 passes over such a buffer).
- log is the GPU's (numpy's in the interpreter), so the draws are an exact Gumbel race up to
  fp32 rounding, not bit-equal to `gumbel_argmax_reference` in every near-tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import next_power_of_2, pdl_enter, pdl_flags, rows_view, width_block

_M32 = 0xFFFFFFFF
SAMPLING_SALT = 0x632BE5AB
"""The vocabulary hash's salt of the sampler's draws (the kernel's constant); other streams take other salts."""


@triton.jit
def _fmix32(x):
    # x uint32: products wrap modulo 2^32, shifts are logical.
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full((), 0xC2B2AE35, tl.uint32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["seed_hash", "temperature"])
def _gumbel_chunk_kernel(x_ptr, keep_ptr, req_ptr, pos_ptr, max_ptr, idx_ptr, stride_x, stride_k, V, n_chunks,
                         seed_hash, temperature, HAS_KEEP: tl.constexpr, UNIT_T: tl.constexpr, BLOCK_V: tl.constexpr,
                         PDL: tl.constexpr):
    # Program (row, chunk): the chunk's best score and the first index holding it.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    h = _fmix32(seed_hash.to(tl.uint32) ^ tl.load(req_ptr + row).to(tl.uint32))
    h = _fmix32(h ^ tl.load(pos_ptr + row).to(tl.uint32))
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_KEEP:
        ok = ok & (tl.load(keep_ptr + row * stride_k + cols, mask=ok, other=0) != 0)
    bits = _fmix32(h ^ _fmix32(cols.to(tl.uint32) + tl.full((), 0x632BE5AB, tl.uint32)))
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if not UNIT_T:
        x = tl.math.div_rn(x, temperature)
    score = tl.where(ok, x - tl.log(-tl.log(u)), float("-inf"))
    tl.store(max_ptr + row * n_chunks + chunk, tl.max(score, axis=0))
    tl.store(idx_ptr + row * n_chunks + chunk, chunk * BLOCK_V + tl.argmax(score, axis=0, tie_break_left=True))


@triton.jit
def _gumbel_pick_kernel(max_ptr, idx_ptr, out_ptr, n_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # The first chunk holding the row's best score, and that chunk's first index of it.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    m = tl.load(max_ptr + row * n_chunks + c, mask=c < n_chunks, other=float("-inf"))
    first = tl.min(tl.where((m == tl.max(m, axis=0)) & (c < n_chunks), c, BLOCK_C), axis=0)
    # No chunk equals the max only where every chunk maximum is NaN (NaN logits): chunk 0, never a read past the
    # row.
    first = tl.where(first < n_chunks, first, 0)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * n_chunks + first))


def fmix32(x):
    """murmur3's 32-bit finaliser on the host: Python ints or int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def seed_hash(seed: int) -> int:
    """The seed's part of every draw's hash (a Python int in [0, 2^32))."""
    return fmix32((seed & _M32) ^ 0x9E3779B9)


def uniforms(seed: int, request_ids: torch.Tensor, positions: torch.Tensor, vocab: int,
             salt: int = SAMPLING_SALT) -> torch.Tensor:
    """[B, V] fp32 in (0, 1): u[b, v] = hash(seed, request_ids[b], positions[b], v); `salt` keys another stream."""
    dev = request_ids.device
    # The seed's hash is a Python int: no host-to-device copy, so a CUDA graph can hold this.
    h = fmix32(seed_hash(seed) ^ (request_ids.long() & _M32))
    h = fmix32(h ^ (positions.long() & _M32))                                    # [B]
    v = torch.arange(vocab, device=dev, dtype=torch.int64)
    return unit_interval(fmix32(h[:, None] ^ fmix32(v + salt)[None, :]))  # [B, V]


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> fp32 strictly inside (0, 1): the top 23 bits plus one half, over 2^23, all exact.
    (24 bits would round the largest value up to 1.0, whose Gumbel noise is +inf: a forced token.)"""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_argmax(logits: torch.Tensor, temperature: float, seed: int, request_ids: torch.Tensor,
                  positions: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [rows]: argmax_v of logits[row, v] / T + Gumbel(seed, request_ids[row], positions[row], v),
    over the entries `keep` (bool [rows, V]) marks, all when None. Runs on CUDA or in the interpreter."""
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"gumbel_argmax: temperature must be > 0, got {temperature!r}")
    x = rows_view("gumbel_argmax", "logits", logits)
    r, v = x.shape
    for name, t in (("request_ids", request_ids), ("positions", positions)):
        if t.shape != (r,) or t.dtype not in (torch.int32, torch.int64) or t.device != logits.device:
            raise ValueError(f"gumbel_argmax: `{name}` must be an int tensor of shape ({r},) on {logits.device}")
    if keep is not None:
        if keep.shape != logits.shape or keep.device != logits.device:
            raise ValueError(f"gumbel_argmax: `keep` must have the logits' shape {tuple(logits.shape)} and device")
        keep = rows_view("gumbel_argmax", "keep", keep.view(torch.uint8) if keep.dtype == torch.bool else keep)
    # The kernel reads one id and one position per row at unit stride (a broadcast position is stride 0).
    request_ids, positions = request_ids.contiguous(), positions.contiguous()
    block = width_block(v, 4096, 256)
    n_chunks = max(triton.cdiv(v, block), 1)
    best = torch.empty((r, n_chunks), device=logits.device, dtype=torch.float32)
    idx = torch.empty((r, n_chunks), device=logits.device, dtype=torch.int64)
    out = idx[:, 0]  # one chunk: its first index of the best score is the row's token
    if r:
        _gumbel_chunk_kernel[(r, n_chunks)](
            x, keep if keep is not None else x, request_ids, positions, best, idx, x.stride(0),
            keep.stride(0) if keep is not None else 0, v, n_chunks, seed_hash(seed), float(temperature),
            HAS_KEEP=keep is not None, UNIT_T=float(temperature) == 1.0, BLOCK_V=block, num_warps=4, **pdl_flags(x),
        )
    if r and n_chunks > 1:
        out = torch.empty(r, device=logits.device, dtype=torch.int64)
        _gumbel_pick_kernel[(r,)](best, idx, out, n_chunks, BLOCK_C=next_power_of_2(n_chunks), num_warps=1,
                                  **pdl_flags(x))
    return out.reshape(logits.shape[:-1])


def gumbel_argmax_reference(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                            keep: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch form, given the uniforms [rows, V] (`uniforms`)."""
    x = logits.float()
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.argmax(x / temperature - torch.log(-torch.log(uniforms)), dim=-1)

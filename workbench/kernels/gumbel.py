"""`gumbel_argmax`: the sampler's draw, argmax over the vocabulary of logits / T + Gumbel noise, fused.

Numerics contract:
- The noise of vocabulary entry v in a row of request r at generation position p is a function
  of (seed, r, p, v) alone: a 32-bit integer hash (murmur3's finaliser, unsigned wrap-around
  arithmetic), u = ((bits >> 9) + 0.5) / 2^23, exact in fp32 and strictly inside (0, 1), and
  g = -log(-log(u)) in fp32.
  `workbench.generation.sampling.uniforms` is the same hash in PyTorch (int64 masked to 32 bits),
  so u is the same bits there.
- score = fp32(logit) / T (IEEE division) + g; entries `keep` leaves out, and padding, are -inf.
- One program per row takes the vocabulary in chunks of BLOCK_V columns in increasing order and
  keeps the first index of the maximum: a row's token depends on its row alone, never on the
  other rows or their number.
- The logits are read once and nothing of [rows, vocab] is written (the PyTorch form,
  `gumbel_argmax_reference`, makes about twenty int64 passes over such a buffer).
- log is the GPU's (numpy's in the interpreter), so the draws are an exact Gumbel race up to
  fp32 rounding, not bit-equal to `gumbel_argmax_reference` in every near-tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import pdl_enter, pdl_flags, rows_view, width_block

_M32 = 0xFFFFFFFF


@triton.jit
def _fmix32(x):
    # x uint32: products wrap modulo 2^32, shifts are logical.
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full((), 0xC2B2AE35, tl.uint32)
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["seed_hash", "temperature"])
def _gumbel_argmax_kernel(x_ptr, keep_ptr, req_ptr, pos_ptr, out_ptr, stride_x, stride_k, V, seed_hash, temperature,
                          HAS_KEEP: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = _fmix32(seed_hash.to(tl.uint32) ^ tl.load(req_ptr + row).to(tl.uint32))
    h = _fmix32(h ^ tl.load(pos_ptr + row).to(tl.uint32))
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        ok = cols < V
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_KEEP:
            ok = ok & (tl.load(keep_ptr + row * stride_k + cols, mask=ok, other=0) != 0)
        bits = _fmix32(h ^ _fmix32(cols.to(tl.uint32) + tl.full((), 0x632BE5AB, tl.uint32)))
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        s = tl.where(ok, tl.math.div_rn(x, temperature) - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(s, axis=0)
        i = tl.argmax(s, axis=0, tie_break_left=True)
        # Strictly greater: an equal maximum in a later chunk keeps the first index.
        take = m > best
        best_i = tl.where(take, start + i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + row, best_i)


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
    out = torch.empty(r, device=logits.device, dtype=torch.int64)
    if r:
        _gumbel_argmax_kernel[(r,)](
            x, keep if keep is not None else x, request_ids, positions, out, x.stride(0),
            keep.stride(0) if keep is not None else 0, v, seed_hash(seed), float(temperature),
            HAS_KEEP=keep is not None, BLOCK_V=width_block(v, 4096, 256), num_warps=8, **pdl_flags(x),
        )
    return out.view(logits.shape[:-1])


def gumbel_argmax_reference(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor,
                            keep: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch form, given the uniforms [rows, V] (`workbench.generation.sampling.uniforms`)."""
    x = logits.float()
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.argmax(x / temperature - torch.log(-torch.log(uniforms)), dim=-1)

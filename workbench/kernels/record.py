"""`record_add`: a decode step's bookkeeping (`Record.add`) in one launch.

As PyTorch ops it is some two dozen small kernels a step (gathers, wheres, scatters, the stop-token test), each a
launch of mostly fixed cost and a node of the step's graph, beside ~30 kernels of the model itself a layer.
Integers and copies only: no value is computed, so the bits are the PyTorch form's (`record_add_reference`,
which the tests hold it to).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import next_power_of_2, pdl_enter, pdl_flags

_BLOCK = 128


@triton.jit
def _record_kernel(rows_ptr, col_ptr, tok_ptr, lp_ptr, slp_ptr, stop_ptr, tokens_ptr, raw_ptr, sampled_ptr,
                   n_out_ptr, done_ptr, B, N, n_stop, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
                   PDL: tl.constexpr):
    # rows are distinct (a request is one row), so no two programs or lanes touch one record row.
    pdl_enter(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < B
    r = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
    col = tl.load(col_ptr).to(tl.int64)
    # A column past the record (which the decode loop never reaches) writes nothing rather than out of bounds.
    running = ok & (col < N) & (tl.load(done_ptr + r, mask=ok, other=1) == 0)
    tok = tl.load(tok_ptr + i, mask=ok, other=0)
    at = r * N + col
    tl.store(tokens_ptr + at, tok, mask=running)
    tl.store(raw_ptr + at, tl.load(lp_ptr + i, mask=ok, other=0.0), mask=running)
    tl.store(sampled_ptr + at, tl.load(slp_ptr + i, mask=ok, other=0.0), mask=running)
    tl.store(n_out_ptr + r, tl.load(n_out_ptr + r, mask=running, other=0) + 1, mask=running)
    s = tl.arange(0, BLOCK_S)
    stops = tl.load(stop_ptr + s, mask=s < n_stop, other=-1)
    hit = tl.max(((tok[:, None] == stops[None, :]) & (s[None, :] < n_stop)).to(tl.int32), axis=1)
    tl.store(done_ptr + r, hit != 0, mask=running & (hit != 0))


def record_add(tokens, raw, sampled, n_out, done, rows, column, tok, lp, slp, stop) -> None:
    """For each row i of the step (rows[i] a record row, distinct) still running (not done): tok[i], lp[i], slp[i]
    into the record at (rows[i], column), one more token counted, and done set where tok[i] is in `stop`."""
    b = rows.numel()
    if b == 0:
        return
    _record_kernel[(triton.cdiv(b, _BLOCK),)](
        rows, column, tok.contiguous(), lp.contiguous(), slp.contiguous(), stop, tokens, raw, sampled, n_out, done,
        b, tokens.shape[1], stop.numel(), BLOCK=_BLOCK, BLOCK_S=next_power_of_2(max(stop.numel(), 1)),
        num_warps=4, **pdl_flags(tok),
    )


def record_add_reference(tokens, raw, sampled, n_out, done, rows, column, tok, lp, slp, stop) -> None:
    """The PyTorch form (any device)."""
    running = ~done[rows]
    col = column.expand_as(rows)
    tokens[rows, col] = torch.where(running, tok, tokens[rows, col])
    raw[rows, col] = torch.where(running, lp, raw[rows, col])
    sampled[rows, col] = torch.where(running, slp, sampled[rows, col])
    n_out[rows] += running.long()
    done[rows] |= (tok[:, None] == stop).any(1) & running

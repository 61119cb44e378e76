"""`linear_logprobs(hidden, weight, tokens)`: the LM head fused with token log-probs (and entropy), in row chunks.

For hidden [N, H], weight [V, H], logits l = hidden @ weight.T and a temperature T:
    logp[i] = log softmax(l[i] / T)[tokens[i]],  entropy[i] = H(softmax(l[i] / T)),
forward and backward, without ever holding [N, V] logits: the rows go through in chunks of `chunk_rows` (a
constant of the machine, never a function of N: only the last chunk is short), and the
backward recomputes each chunk's logits (the idea of Liger's fused linear cross-entropy) but the last: the
forward has just computed those, so when a gradient will be needed it keeps them, and the backward visits the
chunks last to first, starting with the kept one. Memory: one chunk of logits (plus, on the standard path, its
fp32 working copy, and one more fp32 chunk for the entropy's gradient); the last chunk's logits, from the
forward until the backward has used them (at 4096 x 152k bf16, 1.2 GB more between the two; nothing under
no_grad); [4, N] fp32 per-row stats kept from the forward; and an fp32 [V, H] d(weight)
accumulator, unless the weight carries a `main_grad`.

The op composes two ops of the mode switch, `linear` (the logits) and `token_logprobs` (log-probs, entropy and
d(logits)). Both are read once, when the forward runs, and kept for the backward: autograd may run the backward
in another thread, where the mode is the default.

Numerics contract (both `invariant`):
- A chunk's logits are `linear`'s invariant product, matmul(h_c, W.T) rounded once to the inputs' dtype, and
  its log-probs / entropy the row kernels of `logprobs` (`_stats`) on them. Both are row-wise batch invariant,
  so logp and entropy are the same bits as token_logprobs_and_entropy(linear(hidden, weight), tokens, T),
  whatever chunk_rows, N or the other rows: the trainer's log-probs are the generator's.
- Backward, per chunk, last chunk first: the logits (the last chunk's kept from the forward, the others
  recomputed: one deterministic product, the same bits either way), d(logits) by `logprobs`' backward kernel
  from the saved lse2 / E[x2] (fp32, cast once to the inputs' dtype, as LogProbsFn), then d(hidden) =
  matmul(dlogits, W): row-wise, so the same bits as the unfused backward whatever chunk_rows.
- d(weight): the chunks' fp32 products matmul(dlogits.T, h_c) (each a fixed-order reduction over the chunk's
  rows), each added in fp32 in the matmul's epilogue, from the last chunk to the first, onto the weight's fp32
  `main_grad` when the parameter carries one (Megatron-LM's convention, as `linear`: dW is never rounded to
  bf16, no [V, H] buffer, no gradient returned), else onto fp32 zeros cast once to the weight's dtype.
  Deterministic run to run, but its rounding depends on chunk_rows (the sum over tokens is grouped by chunks;
  the unfused dW reduces over all N rows in one chain). With one chunk it is the unfused bits: `linear`'s dW,
  or main_grad + the same fp32 product, `linear`'s main_grad path.
- Standard path (both `standard`): cuBLAS logits (F.linear), one fp32 copy, in-place log-sum-exp arithmetic
  (the kept chunk is the dtype's logits; the backward makes its fp32 copy, as for a recomputed chunk);
  torch.mm for the gradients, d(weight) accumulated in fp32 by cuBLAS (bf16 operands, fp32 C: main_grad or the
  zeros; where torch lacks that, as on the CPU, each chunk's product is rounded to bf16 before the fp32 sum).
  Mixed overrides compose per chunk: logits and d(hidden), d(weight) products by the `linear` mode, log-probs,
  entropy and d(logits) by the `token_logprobs` mode.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
import triton
from torch.autograd.function import once_differentiable

from .runtime import check_device, check_float, check_same, interpreting, pdl_flags
from .logprobs import _LOG2E, _config, _logprobs_bwd_kernel, _stats
from .matmul import matmul
from .mode import get_mode

# Rows per chunk. GPU: enough rows that d(weight) takes few fp32 accumulations, while one chunk of logits stays
# modest (4096 x 152k bf16 = 1.2 GB). A whole 16k micro-batch's completions in one chunk (12,288 rows, kept from
# the forward: no recomputed logits) measured no faster for 2.4 GiB more (BENCHMARKS.md, "Numbers behind the code"). Interpreter: two of its
# matmul's 32-row tiles.
_CHUNK_ROWS_GPU = 4096
_CHUNK_ROWS_INTERPRETER = 64
# d(weight) is accumulated in slices of this many vocabulary rows, so no second fp32 [V, H] product is held; each
# output row of the product is its own chain, so slicing changes no bits.
_DW_SLICE = 16384


def _default_chunk_rows() -> int:
    """The chunk size `linear_logprobs` takes when given none (a function of the machine only)."""
    return _CHUNK_ROWS_INTERPRETER if interpreting() else _CHUNK_ROWS_GPU


def _logits(h: torch.Tensor, weight: torch.Tensor, inv_linear: bool) -> torch.Tensor:
    # Exactly `linear_invariant` without a bias: the bits the unfused path gives.
    return matmul(h, weight.t()) if inv_linear else F.linear(h, weight)


def _standard_stats(x: torch.Tensor, tok: torch.Tensor, temperature: float, with_entropy: bool) -> torch.Tensor:
    """[4, rows] fp32: log-prob, entropy (or NaN), lse, E[x] of x = logits / T, natural log; `x` (a fresh fp32
    chunk of logits) is overwritten."""
    if temperature != 1.0:
        x.div_(temperature)
    out = torch.full((4, x.shape[0]), float("nan"), device=x.device, dtype=torch.float32)
    x_tok = x.gather(1, tok.long()[:, None])[:, 0]
    m = x.amax(1, keepdim=True)
    e = x.sub_(m).exp_()  # torch.logsumexp would allocate two more [rows, V] buffers
    s = e.sum(1)
    lse = m[:, 0] + s.log()
    out[0], out[2] = x_tok - lse, lse
    if with_entropy:
        # sum(e * (x - m)) as sum(e * log e), in place; an underflowed e contributes 0, as it should.
        ent = s.log() - e.xlogy_(e).sum(1) / s
        out[1], out[3] = ent, lse - ent
    return out


def _standard_dlogits(x, tok, stats, g_lp, g_ent, temperature, dtype) -> torch.Tensor:
    """(g_lp * (onehot - p) - g_ent * p * (x - E[x])) / T in fp32 over `x` (fresh fp32 logits), cast once."""
    # The gradient is linear in (g_lp, g_ent): dividing them by T costs no [rows, V] pass.
    g_lp = (g_lp / temperature)[:, None]
    if temperature != 1.0:
        x.div_(temperature)
    x.sub_(stats[2][:, None])  # log p
    if g_ent is None:
        x.exp_().mul_(-g_lp)
    else:
        # x - E[x] = log p + entropy; q = -(g_lp + g_ent * (x - E[x])) needs p and log p at once: one more buffer.
        q = (x + stats[1][:, None]).mul_(-(g_ent / temperature)[:, None]).sub_(g_lp)
        x.exp_().mul_(q)
        del q
    x.scatter_add_(1, tok.long()[:, None], g_lp)
    return x.to(dtype)


def _invariant_dlogits(logits, tok, stats, g_lp, g_ent, temperature) -> torch.Tensor:
    """LogProbsFn's backward kernel (same arguments, same bits), written over `logits`: each program reads its
    block of a row before it stores that block, and no program reads another's block."""
    r, v = logits.shape
    cfg = _config(v)
    _logprobs_bwd_kernel[(r, triton.cdiv(v, cfg["backward_block_v"]))](
        logits, tok, stats, g_lp, g_lp if g_ent is None else g_ent, logits, logits.stride(0), logits.stride(0), v,
        _LOG2E / float(temperature), 1.0 / float(temperature), r,
        BLOCK_V=cfg["backward_block_v"], WITH_ENTROPY=g_ent is not None, num_warps=cfg["backward_num_warps"],
        **pdl_flags(logits),
    )
    return logits


def _add_dw(dw32: torch.Tensor, dl: torch.Tensor, h: torch.Tensor, inv_linear: bool) -> None:
    """dw32 += dl.T @ h, in fp32, a slice of vocabulary rows at a time."""
    for v0 in range(0, dl.shape[1], _DW_SLICE):
        d, acc = dl[:, v0 : v0 + _DW_SLICE].t(), dw32[v0 : v0 + _DW_SLICE]
        if inv_linear:
            matmul(d, h, accumulate=acc)  # acc + the fp32 product, added in the kernel's epilogue
        elif dl.dtype == torch.float32:
            acc.addmm_(d, h)
        elif _mm_accumulates_in_fp32(dl.device.type):
            torch.addmm(acc, d, h, out_dtype=torch.float32, out=acc)  # bf16 operands, fp32 C, beta = 1
        else:
            acc += torch.mm(d, h)  # one bf16 rounding per chunk (the product), summed in fp32


@cache
def _mm_accumulates_in_fp32(device_type: str) -> bool:
    """Whether cuBLAS's bf16 x bf16 -> fp32 GEMM is reachable here (CUDA, torch >= 2.8)."""
    return device_type == "cuda" and "dtype_out" in torch.ops.aten.addmm.overloads()


class LinearLogProbsFn(torch.autograd.Function):
    """(hidden, weight, tokens, T, with_entropy, chunk_rows, inv_linear, inv_lp, grad) -> (log-probs, entropy or
    NaN). `grad`: whether autograd records this call (grad mode was on): inside `forward` grad mode is off, and
    `ctx.needs_input_grad` reports requires_grad alone, so it cannot tell a no_grad scoring forward."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, with_entropy, chunk_rows, inv_linear, inv_lp, grad):
        n = hidden.shape[0]
        stats = torch.empty((4, n), device=hidden.device, dtype=torch.float32)
        last = (n - 1) // chunk_rows * chunk_rows
        keep = grad and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        ctx.kept = None
        for s in range(0, n, chunk_rows):
            h, tok = hidden[s : s + chunk_rows], tokens[s : s + chunk_rows]
            logits = _logits(h, weight, inv_linear)
            if keep and s == last:
                ctx.kept = logits
            if inv_lp:
                stats[:, s : s + chunk_rows] = _stats(logits, tok, temperature, with_entropy)
            else:  # unless kept, the bf16 logits die as their fp32 copy is made (kept fp32 ones are copied too:
                # `_standard_stats` overwrites its input)
                logits = logits.to(torch.float32, copy=ctx.kept is logits)
                stats[:, s : s + chunk_rows] = _standard_stats(logits, tok, temperature, with_entropy)
            del logits
        ctx.save_for_backward(hidden, weight, tokens, stats)
        # The parameter object itself, for its `main_grad` (as LinearFn: under activation checkpointing the saved
        # weight comes back as another tensor object, without the attribute).
        ctx.param = weight
        ctx.config = (temperature, with_entropy, chunk_rows, inv_linear, inv_lp)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its work is skipped
        # Copies: callers may modify the outputs in place; `stats` is saved for the backward.
        return stats[0].clone(), stats[1].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, tokens, stats = ctx.saved_tensors
        temperature, with_entropy, chunk_rows, inv_linear, inv_lp = ctx.config
        n, want_dh, want_dw = hidden.shape[0], ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_lp = torch.zeros(n, device=hidden.device, dtype=torch.float32) if g_lp is None else g_lp.float().contiguous()
        g_ent = g_ent.float().contiguous() if with_entropy and g_ent is not None else None
        dh = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if want_dh else None
        main_grad = getattr(ctx.param, "main_grad", None) if want_dw else None
        dw32 = main_grad
        if want_dw and main_grad is None:
            dw32 = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        # Taken off ctx, so the kept chunk dies as soon as it is used; a second backward (retain_graph) recomputes.
        kept, ctx.kept = ctx.kept, None
        for s in reversed(range(0, n, chunk_rows)):
            e = min(s + chunk_rows, n)
            h, tok, st = hidden[s:e], tokens[s:e], stats[:, s:e].contiguous()
            ge = None if g_ent is None else g_ent[s:e]
            x, kept = (_logits(h, weight, inv_linear) if kept is None else kept), None
            if inv_lp:
                dl = _invariant_dlogits(x, tok, st, g_lp[s:e], ge, temperature)
            else:  # the bf16 logits die as their fp32 copy is made
                x = x.float()
                dl = _standard_dlogits(x, tok, st, g_lp[s:e], ge, temperature, hidden.dtype)
            del x
            if want_dh:
                dh[s:e] = matmul(dl, weight) if inv_linear else torch.mm(dl, weight)
            if want_dw:
                _add_dw(dw32, dl, h, inv_linear)
            del dl
        dw = dw32.to(weight.dtype) if want_dw and main_grad is None else None
        return dh, dw, None, None, None, None, None, None, None


def _check(hidden, weight, tokens, temperature, chunk_rows) -> None:
    op = "linear_logprobs"
    check_float(op, "hidden", hidden)
    check_float(op, "weight", weight)
    check_same(op, {"hidden": hidden, "weight": weight})
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{op}: hidden must be [N, H] and weight [V, H] with the same H; "
            f"got hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"{op}: weight has no rows (an empty vocabulary)")
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        got = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise TypeError(f"{op}: tokens must be an int64 or int32 tensor, got {got}")
    if tuple(tokens.shape) != (hidden.shape[0],):
        raise ValueError(f"{op}: tokens must have shape ({hidden.shape[0]},) (one per row), got {tuple(tokens.shape)}")
    check_same(op, {"hidden": hidden, "tokens": tokens}, dtype=False)
    # A host-side range check is free on the CPU; on the GPU the invariant kernels give NaN for a bad token.
    if tokens.device.type == "cpu" and tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"{op}: token ids must lie in [0, {weight.shape[0]}), got [{lo}, {hi}]")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise ValueError(f"{op}: temperature must be a positive finite number, got {temperature!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"{op}: chunk_rows must be a positive int, got {chunk_rows!r}")


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_rows: int | None = None):
    """hidden [N, H] (bf16 or fp32), weight [V, H] same dtype, tokens [N] int64/int32 ->
    (logp [N] fp32, entropy [N] fp32 or None), of softmax(hidden @ weight.T / T), never holding [N, V] logits.
    Differentiable in hidden and weight (and through the entropy when with_entropy). chunk_rows=None: 4096 rows
    on the GPU, 64 in the interpreter. Modes of `linear` and `token_logprobs`, read here, once."""
    chunk_rows = _default_chunk_rows() if chunk_rows is None else chunk_rows
    _check(hidden, weight, tokens, temperature, chunk_rows)
    inv_linear = get_mode("linear") == "invariant"
    inv_lp = get_mode("token_logprobs") == "invariant"
    if inv_linear or inv_lp:
        check_device("linear_logprobs", hidden)
    logp, ent = LinearLogProbsFn.apply(hidden, weight, tokens.contiguous(), float(temperature), bool(with_entropy),
                                       chunk_rows, inv_linear, inv_lp, torch.is_grad_enabled())
    return logp, (ent if with_entropy else None)


def linear_logprobs_reference(hidden, weight, tokens, temperature: float = 1.0):
    """fp64 reference (differentiable): (log-probs, entropy)."""
    lp = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, dim=-1)
    return lp.gather(-1, tokens.long()[:, None])[:, 0], -(lp.exp() * lp).sum(-1)

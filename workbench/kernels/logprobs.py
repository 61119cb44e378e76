"""`token_logprobs(logits, tokens)` and `entropy(logits)`: row-wise in fp32, forward and backward.

For a row of logits l (bf16 or fp32) and a temperature T:
    lse = log(sum(exp(l / T))),  token_logprobs = l[token] / T - lse,
    entropy = lse - sum(p * l / T) with p = exp(l / T - lse).

Numerics contract (mode `invariant`):
- Logits are upcast to fp32 right after the load; nothing is rounded below fp32.
- All of it runs in base 2, where the GPU's exp2/log2 are native: x2 = l * s
  with s = log2(e) / T rounded to fp32 once; lse2 = log2(sum(2^x2));
  token_logprobs = (x2[token] - lse2) * ln2; entropy = (lse2 - E_p[x2]) * ln2.
- The vocabulary is cut into fixed chunks of CHUNK_V columns (a function of
  nothing but the GPU/interpreter, never of the number of rows). A chunk is
  held in registers: its max m, sum 2^(x2 - m) and sum 2^(x2 - m) * x2 are each
  one `tl.max`/`tl.sum` tree (one exp2 per logit). A second kernel combines
  the chunks of a row by one more tree over the chunks (rescaled by 2^(m_c - max)),
  its width the next power of two of the chunk count, again a function of V
  alone. So a row's results are the same bits whatever the other rows, their
  number or padding rows, and the chunks give parallelism when there are few rows.
- -inf logits (masked vocabulary) contribute exact zeros; a token outside
  [0, V) gives NaN (the kernel never reads outside the row).
- Memory: no [rows, vocab] buffer in the forward (only [rows, chunks]
  partials); the backward writes the gradient, the one [rows, vocab] buffer.
- Backward, in fp32 and cast once to the logits' dtype, with p_j = 2^(x2_j - lse2):
  d/dl_j = (g_lp * (1[j = token] - p_j) - g_ent * p_j * (x2_j - E_p[x2]) * ln2) / T.
- `token_logprobs` alone skips the entropy sums (same log-prob bits either way).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .runtime import check_device, check_float, next_power_of_2, pdl_enter, pdl_flags, rows_view, width_block
from .mode import get_mode


@triton.jit
def _lse_partials_kernel(
    x_ptr, part_ptr, stride_x, V, scale, n_chunks,
    CHUNK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    PDL: tl.constexpr,
):
    # Base-2 units: x2 = logit * (log2(e) / T), so exp2 needs no extra multiply.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK_V + tl.arange(0, CHUNK_V)
    x2 = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
    m = tl.max(x2, axis=0)
    # A chunk of only -inf keeps m = -inf; shift by 0 there so no -inf - -inf appears.
    shift = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp2(x2 - shift)
    base = part_ptr + (row * n_chunks + chunk) * 3
    tl.store(base, m)
    tl.store(base + 1, tl.sum(e, axis=0))
    if WITH_ENTROPY:
        tl.store(base + 2, tl.sum(e * tl.where(x2 == float("-inf"), 0.0, x2), axis=0))


@triton.jit
def _lse_combine_kernel(
    x_ptr, tok_ptr, part_ptr, out_ptr, stride_x, V, scale, n_rows, n_chunks,
    BLOCK_C: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    PDL: tl.constexpr,
):
    # out rows: 0 log-prob, 1 entropy (NaN unless WITH_ENTROPY), 2 lse2, 3 E[x2], all per row.
    pdl_enter(PDL)
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok_c = c < n_chunks
    base = part_ptr + row * n_chunks * 3 + c * 3
    m_c = tl.load(base, mask=ok_c, other=float("-inf"))
    m = tl.max(m_c, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(m_c - shift)
    s = tl.sum(tl.load(base + 1, mask=ok_c, other=0.0) * w, axis=0)
    lse2 = m + tl.log2(s)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    ok = (tok >= 0) & (tok < V)
    x2_tok = tl.load(x_ptr + row * stride_x + tok, mask=ok, other=0.0).to(tl.float32) * scale
    tl.store(out_ptr + row, tl.where(ok, (x2_tok - lse2) * LN2, float("nan")))
    tl.store(out_ptr + 2 * n_rows + row, lse2)
    if WITH_ENTROPY:
        mean2 = tl.sum(tl.load(base + 2, mask=ok_c, other=0.0) * w, axis=0) / s
        tl.store(out_ptr + n_rows + row, (lse2 - mean2) * LN2)
        tl.store(out_ptr + 3 * n_rows + row, mean2)
    else:
        tl.store(out_ptr + n_rows + row, float("nan"))


@triton.jit
def _logprobs_bwd_kernel(
    x_ptr, tok_ptr, stats_ptr, g_lp_ptr, g_ent_ptr, dx_ptr,
    stride_x, stride_dx, V, scale, inv_t, n_rows,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x2 = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32) * scale
    lse2 = tl.load(stats_ptr + 2 * n_rows + row)
    g_lp = tl.load(g_lp_ptr + row)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    p = tl.exp2(x2 - lse2)
    dx = g_lp * (tl.where(cols == tok, 1.0, 0.0) - p)
    if WITH_ENTROPY:
        mean2 = tl.load(stats_ptr + 3 * n_rows + row)
        g_ent = tl.load(g_ent_ptr + row)
        dx -= g_ent * p * ((tl.where(x2 == float("-inf"), mean2, x2) - mean2) * LN2)
    tl.store(dx_ptr + row * stride_dx + cols, (dx * inv_t).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logprob_rows_kernel(x_ptr, stats_ptr, out_ptr, stride_x, stride_o, V, scale, n_rows, BLOCK_V: tl.constexpr,
                         PDL: tl.constexpr):
    # The combine kernel's token expression, for every column: (x2 - lse2) * ln2 with the same lse2.
    pdl_enter(PDL)
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x2 = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32) * scale
    lse2 = tl.load(stats_ptr + 2 * n_rows + row)
    tl.store(out_ptr + row * stride_o + cols, (x2 - lse2) * LN2, mask=mask)


_LOG2E = math.log2(math.e)

# Fixed per machine kind and vocabulary width, never a function of the rows (tools/tune/tune_rowwise.py chose
# the GPU one; the interpreter's small blocks apply to small vocabularies only: `width_block`).
_GPU_CONFIG = {"chunk_v": 4096, "forward_num_warps": 4, "backward_block_v": 1024, "backward_num_warps": 4}
_INTERPRETER_CONFIG = {"chunk_v": 256, "forward_num_warps": 4, "backward_block_v": 128, "backward_num_warps": 4}


def _config(v: int) -> dict:
    return {k: width_block(v, _GPU_CONFIG[k], _INTERPRETER_CONFIG[k]) for k in _GPU_CONFIG}


def tile_config() -> dict:
    """The launch config in force here (for the environment record), small and real vocabularies."""
    return {"vocab_8k_or_less" if v <= 8192 else "vocab_above_8k": _config(v) for v in (512, 151936)}


def _check(logits: torch.Tensor, tokens: torch.Tensor | None, temperature: float) -> None:
    check_float("token_logprobs", "logits", logits)
    if logits.dim() == 0:
        raise ValueError("token_logprobs: logits must be [..., vocab], got a scalar")
    if tokens is not None:
        if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
            got = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise TypeError(f"token_logprobs: tokens must be an int64 or int32 tensor, got {got}")
        if tuple(tokens.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"token_logprobs: tokens must have shape {tuple(logits.shape[:-1])} "
                f"(logits without the vocab dimension), got {tuple(tokens.shape)}"
            )
        if tokens.device != logits.device:
            raise ValueError(f"token_logprobs: logits on {logits.device} but tokens on {tokens.device}")
        # A host-side range check is free on the CPU; on the GPU the kernel marks bad tokens NaN.
        if tokens.device.type == "cpu" and tokens.numel():
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < 0 or hi >= logits.shape[-1]:
                raise ValueError(f"token_logprobs: token ids must lie in [0, {logits.shape[-1]}), got [{lo}, {hi}]")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"token_logprobs: temperature must be a positive number, got {temperature!r}")


def _stats(x2: torch.Tensor, tok: torch.Tensor, temperature: float, with_entropy: bool) -> torch.Tensor:
    """[4, rows] fp32: log-prob, entropy (or NaN), lse2, E[x2] (the last two in base 2)."""
    r, v = x2.shape
    cfg = _config(v)
    n_chunks = triton.cdiv(v, cfg["chunk_v"])
    part = torch.empty((r, n_chunks, 3), device=x2.device, dtype=torch.float32)
    out = torch.empty((4, r), device=x2.device, dtype=torch.float32)
    scale = _LOG2E / float(temperature)
    if r > 0:
        _lse_partials_kernel[(r, n_chunks)](
            x2, part, x2.stride(0), v, scale, n_chunks, CHUNK_V=cfg["chunk_v"], WITH_ENTROPY=with_entropy,
            num_warps=cfg["forward_num_warps"], **pdl_flags(x2),
        )
        _lse_combine_kernel[(r,)](
            x2, tok, part, out, x2.stride(0), v, scale, r, n_chunks,
            BLOCK_C=next_power_of_2(n_chunks), WITH_ENTROPY=with_entropy, num_warps=1, **pdl_flags(x2),
        )
    return out


class LogProbsFn(torch.autograd.Function):
    """(logits, tokens, T, with_entropy) -> (token log-probs, entropy or NaN), fp32 of logits.shape[:-1]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool):
        check_device("token_logprobs", logits)
        x2 = rows_view("token_logprobs", "logits", logits)
        tok = tokens.reshape(x2.shape[0]).contiguous()
        out = _stats(x2, tok, temperature, with_entropy)
        ctx.save_for_backward(x2, tok, out)
        ctx.scale, ctx.inv_t, ctx.with_entropy = _LOG2E / float(temperature), 1.0 / float(temperature), with_entropy
        ctx.shape = logits.shape
        ctx.mark_non_differentiable(tokens)
        lead = logits.shape[:-1]
        # Copies: callers may modify the outputs in place; `out` is saved for the backward.
        return out[0].reshape(lead).clone(), out[1].reshape(lead).clone()

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        x2, tok, stats = ctx.saved_tensors
        r, v = x2.shape
        zeros = torch.zeros(r, device=x2.device, dtype=torch.float32)
        g_lp = zeros if g_lp is None else g_lp.reshape(r).float().contiguous()
        with_entropy = ctx.with_entropy and g_ent is not None
        g_ent = zeros if g_ent is None else g_ent.reshape(r).float().contiguous()
        dx = torch.empty((r, v), device=x2.device, dtype=x2.dtype)
        cfg = _config(v)
        if r > 0:
            _logprobs_bwd_kernel[(r, triton.cdiv(v, cfg["backward_block_v"]))](
                x2, tok, stats, g_lp, g_ent, dx, x2.stride(0), dx.stride(0), v, ctx.scale, ctx.inv_t, r,
                BLOCK_V=cfg["backward_block_v"], WITH_ENTROPY=with_entropy, num_warps=cfg["backward_num_warps"],
                **pdl_flags(x2),
            )
        return dx.view(ctx.shape), None, None, None


def logprobs_and_entropy_invariant(logits, tokens, temperature: float = 1.0, with_entropy: bool = True):
    _check(logits, tokens, temperature)
    return LogProbsFn.apply(logits, tokens, temperature, with_entropy)


def logprobs_and_entropy_standard(logits, tokens, temperature: float = 1.0):
    """The usual path: an fp32 [rows, vocab] log_softmax, then gather."""
    _check(logits, tokens, temperature)
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).nan_to_num(0.0).sum(-1)
    return logp, ent


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0):
    """(fp32 log-prob of each token, fp32 entropy of each row) in one pass over the logits."""
    if get_mode("token_logprobs") == "standard":
        return logprobs_and_entropy_standard(logits, tokens, temperature)
    return logprobs_and_entropy_invariant(logits, tokens, temperature)


def logsumexp(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log(sum(exp(logits / T))) per row, no gradient; the same bits the log-prob kernel uses
    (invariant mode), or torch.logsumexp (standard mode). Mode of `token_logprobs`."""
    _check(logits, None, temperature)
    if get_mode("token_logprobs") == "standard":
        return torch.logsumexp(logits.float() / temperature, dim=-1)
    check_device("logsumexp", logits)
    x2 = rows_view("logsumexp", "logits", logits.detach())
    out = _stats(x2, torch.zeros(x2.shape[0], dtype=torch.int64, device=x2.device), temperature, False)
    return (out[2] * math.log(2.0)).view(logits.shape[:-1])


def logprob_rows(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log softmax(logits / T) over the whole vocabulary, [..., V], no gradient.

    Invariant mode: each entry is the bits `token_logprobs` gives for that token (same lse, same
    expression), so a sampler that draws from these rows reports the trainer's log-probs. For
    samplers that need full rows (vLLM); the trainer itself never materialises them.
    Standard mode: torch.log_softmax in fp32.
    """
    _check(logits, None, temperature)
    if get_mode("token_logprobs") == "standard":
        return torch.log_softmax(logits.detach().float() / temperature, dim=-1)
    check_device("logprob_rows", logits)
    x2 = rows_view("logprob_rows", "logits", logits.detach())
    r, v = x2.shape
    stats = _stats(x2, torch.zeros(r, dtype=torch.int64, device=x2.device), temperature, False)
    out = torch.empty((r, v), device=x2.device, dtype=torch.float32)
    cfg = _config(v)
    if r > 0:
        _logprob_rows_kernel[(r, triton.cdiv(v, cfg["backward_block_v"]))](
            x2, stats, out, x2.stride(0), out.stride(0), v, _LOG2E / float(temperature), r,
            BLOCK_V=cfg["backward_block_v"], num_warps=cfg["backward_num_warps"], **pdl_flags(x2),
        )
    return out.view(logits.shape)


def _zero_tokens(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)


def token_logprobs_invariant(logits, tokens, temperature: float = 1.0):
    return logprobs_and_entropy_invariant(logits, tokens, temperature, with_entropy=False)[0]


def token_logprobs_standard(logits, tokens, temperature: float = 1.0):
    return logprobs_and_entropy_standard(logits, tokens, temperature)[0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log p(token) under softmax(logits / T), by the kernel the mode picks for `token_logprobs`."""
    if get_mode("token_logprobs") == "standard":
        return token_logprobs_standard(logits, tokens, temperature)
    return token_logprobs_invariant(logits, tokens, temperature)


def entropy_invariant(logits, temperature: float = 1.0):
    return logprobs_and_entropy_invariant(logits, _zero_tokens(logits), temperature)[1]


def entropy_standard(logits, temperature: float = 1.0):
    return logprobs_and_entropy_standard(logits, _zero_tokens(logits), temperature)[1]


def entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 entropy of softmax(logits / T) per row, by the kernel the mode picks for `entropy`."""
    if get_mode("entropy") == "standard":
        return entropy_standard(logits, temperature)
    return entropy_invariant(logits, temperature)


def token_logprobs_reference(logits, tokens, temperature: float = 1.0):
    """fp64 reference."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return lp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def entropy_reference(logits, temperature: float = 1.0):
    """fp64 reference."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(lp.exp() * lp).nan_to_num(0.0).sum(-1)


def logsumexp_reference(logits, temperature: float = 1.0):
    """fp64 reference."""
    return torch.logsumexp(logits.double() / temperature, dim=-1)


def logprob_rows_reference(logits, temperature: float = 1.0):
    """fp64 reference."""
    return torch.log_softmax(logits.double() / temperature, dim=-1)

"""`token_logprobs(logits, tokens)` and `entropy(logits)`: row-wise in fp32, forward and backward.

For a row of logits l (bf16 or fp32) and a temperature T, with x = l * (1/T) in fp32
(1/T rounded to fp32 once; exact for T = 1):
    lse = log(sum(exp(x))),  token_logprobs = x[token] - lse,
    entropy = lse - sum(p * x) with p = exp(x - lse).

Numerics contract (mode `invariant`):
- Logits are upcast to fp32 right after the load; nothing is rounded below fp32.
- The vocabulary is cut into fixed chunks of CHUNK_V columns (a function of
  nothing but the GPU/interpreter, never of the number of rows). A chunk is
  held in registers: its max m, sum exp(x - m) and sum exp(x - m) * x are each
  one `tl.sum`/`tl.max` tree (one exp per logit). The chunks are combined in
  increasing order by a second kernel (online rescaling). So a row's results
  are the same bits whatever the other rows, their number or padding rows,
  and the chunks give parallelism when there are few rows.
- -inf logits (masked vocabulary) contribute exact zeros; a token outside
  [0, V) gives NaN (the kernel never reads outside the row).
- Memory: no [rows, vocab] buffer in the forward (only [rows, chunks]
  partials); the backward writes the gradient, the one [rows, vocab] buffer.
- Backward, in fp32 and cast once to the logits' dtype:
  d/dl_j = (g_lp * (1[j = token] - p_j) - g_ent * p_j * (x_j - E_p[x])) / T.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, interpreting, rows_view
from .mode import get_mode


@triton.jit
def _lse_partials_kernel(
    x_ptr, part_ptr, stride_x, V, inv_t, n_chunks,
    CHUNK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK_V + tl.arange(0, CHUNK_V)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
    m = tl.max(x, axis=0)
    # A chunk of only -inf keeps m = -inf; shift by 0 there so no -inf - -inf appears.
    shift = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(x - shift)
    s = tl.sum(e, axis=0)
    t = tl.sum(e * tl.where(x == float("-inf"), 0.0, x), axis=0)
    base = part_ptr + (row * n_chunks + chunk) * 3
    tl.store(base, m)
    tl.store(base + 1, s)
    tl.store(base + 2, t)


@triton.jit
def _lse_combine_kernel(
    x_ptr, tok_ptr, part_ptr, logp_ptr, ent_ptr, lse_ptr, mean_ptr,
    stride_x, V, inv_t, n_chunks,
):
    row = tl.program_id(0).to(tl.int64)
    base = part_ptr + row * n_chunks * 3
    m = tl.load(base)
    s = tl.load(base + 1)
    t = tl.load(base + 2)
    for c in range(1, n_chunks):
        cm = tl.load(base + c * 3)
        cs = tl.load(base + c * 3 + 1)
        ct = tl.load(base + c * 3 + 2)
        m_new = tl.maximum(m, cm)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - shift)
        b = tl.exp(cm - shift)
        s = s * a + cs * b
        t = t * a + ct * b
        m = m_new
    lse = m + tl.log(s)
    mean = t / s
    tok = tl.load(tok_ptr + row).to(tl.int64)
    ok = (tok >= 0) & (tok < V)
    x_tok = tl.load(x_ptr + row * stride_x + tok, mask=ok, other=0.0).to(tl.float32) * inv_t
    tl.store(logp_ptr + row, tl.where(ok, x_tok - lse, float("nan")))
    tl.store(ent_ptr + row, lse - mean)
    tl.store(lse_ptr + row, lse)
    tl.store(mean_ptr + row, mean)


@triton.jit
def _logprobs_bwd_kernel(
    x_ptr, tok_ptr, lse_ptr, mean_ptr, g_lp_ptr, g_ent_ptr, dx_ptr,
    stride_x, stride_dx, V, inv_t,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
    lse = tl.load(lse_ptr + row)
    mean = tl.load(mean_ptr + row)
    g_lp = tl.load(g_lp_ptr + row)
    g_ent = tl.load(g_ent_ptr + row)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    p = tl.exp(x - lse)
    hit = tl.where(cols == tok, 1.0, 0.0)
    d_ent = p * (tl.where(x == float("-inf"), mean, x) - mean)
    dx = (g_lp * (hit - p) - g_ent * d_ent) * inv_t
    tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Fixed per machine kind, never a function of the rows (bench/tune_rowwise.py chose the GPU one).
_GPU_CONFIG = {"chunk_v": 4096, "forward_num_warps": 8, "backward_block_v": 1024, "backward_num_warps": 4}
_INTERPRETER_CONFIG = {"chunk_v": 256, "forward_num_warps": 4, "backward_block_v": 128, "backward_num_warps": 4}


def _config() -> dict:
    return _INTERPRETER_CONFIG if interpreting() else _GPU_CONFIG


def tile_config() -> dict:
    """The launch config in force here (for the environment record)."""
    return dict(_config())


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


class LogProbsFn(torch.autograd.Function):
    """(logits, tokens, T) -> (token log-probs, entropy), both fp32 of logits.shape[:-1]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
        check_device("token_logprobs", logits)
        x2 = rows_view("token_logprobs", "logits", logits)
        r, v = x2.shape
        tok = tokens.reshape(r).contiguous()
        cfg = _config()
        n_chunks = triton.cdiv(v, cfg["chunk_v"])
        dev = logits.device
        part = torch.empty((r, n_chunks, 3), device=dev, dtype=torch.float32)
        out = torch.empty((4, r), device=dev, dtype=torch.float32)
        logp, ent, lse, mean = out
        inv_t = 1.0 / float(temperature)
        if r > 0:
            _lse_partials_kernel[(r, n_chunks)](
                x2, part, x2.stride(0), v, inv_t, n_chunks, CHUNK_V=cfg["chunk_v"],
                num_warps=cfg["forward_num_warps"],
            )
            _lse_combine_kernel[(r,)](
                x2, tok, part, logp, ent, lse, mean, x2.stride(0), v, inv_t, n_chunks, num_warps=1,
            )
        ctx.save_for_backward(x2, tok, lse, mean)
        ctx.inv_t = inv_t
        ctx.shape = logits.shape
        ctx.mark_non_differentiable(tokens)
        lead = logits.shape[:-1]
        return logp.view(lead), ent.view(lead)

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        x2, tok, lse, mean = ctx.saved_tensors
        r, v = x2.shape
        zeros = torch.zeros(r, device=x2.device, dtype=torch.float32)
        g_lp = zeros if g_lp is None else g_lp.reshape(r).float().contiguous()
        g_ent = zeros if g_ent is None else g_ent.reshape(r).float().contiguous()
        dx = torch.empty((r, v), device=x2.device, dtype=x2.dtype)
        cfg = _config()
        if r > 0:
            _logprobs_bwd_kernel[(r, triton.cdiv(v, cfg["backward_block_v"]))](
                x2, tok, lse, mean, g_lp, g_ent, dx, x2.stride(0), dx.stride(0), v, ctx.inv_t,
                BLOCK_V=cfg["backward_block_v"], num_warps=cfg["backward_num_warps"],
            )
        return dx.view(ctx.shape), None, None


def logprobs_and_entropy_invariant(logits, tokens, temperature: float = 1.0):
    _check(logits, tokens, temperature)
    return LogProbsFn.apply(logits, tokens, temperature)


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


def _zero_tokens(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros(logits.shape[:-1], dtype=torch.int64, device=logits.device)


def token_logprobs_invariant(logits, tokens, temperature: float = 1.0):
    return logprobs_and_entropy_invariant(logits, tokens, temperature)[0]


def token_logprobs_standard(logits, tokens, temperature: float = 1.0):
    return logprobs_and_entropy_standard(logits, tokens, temperature)[0]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log p(token) under softmax(logits / T), by the kernel the mode picks for `token_logprobs`."""
    return token_logprobs_and_entropy(logits, tokens, temperature)[0]


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

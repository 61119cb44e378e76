"""Sampling parameters, per-request random numbers, and the two log-prob definitions.

The uniform number for vocabulary entry v at position p of request r is an integer hash of (seed, r, p, v), the same
on any device and in any batch; sampling is Gumbel-max over the kept vocabulary (one fused kernel,
`workbench.kernels.gumbel`): an exact draw from softmax(logits / T) on the kept set, up to u's 2^-23 quantisation.
`logit_noise` > 0 adds seeded Gaussian noise of that size to the logits: a controlled sampler-trainer mismatch. Every
sampled token gets two log-probs, `raw` (the model's own at temperature 1, what a trainer's forward computes) and
`sampled` (in the distribution actually sampled from), both from `workbench.kernels.token_logprobs`, so a trainer
that calls the same functions on the same logits gets the same bits. In full: docs/generation.md,
"`workbench/generation/sampling.py`: per-request random numbers and the two log-probs".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import gumbel_argmax, logsumexp, row_cumsum, token_logprobs
from ..kernels.runtime import interpreting
from ..kernels.gumbel import gumbel_argmax_reference, seed_hash, uniforms, unit_interval  # noqa: F401 (re-exported)

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the top_k most likely tokens (0 keeps all)."""
    max_new_tokens: int = 64
    """Generate at most this many tokens per request."""
    stop_token_ids: tuple[int, ...] = ()
    """A request finishes after sampling one of these."""
    seed: int = 0
    """Seed of every request's random numbers."""
    logit_noise: float = 0.0
    """Std of the seeded Gaussian perturbation added to the logits before sampling (0: none)."""

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.logit_noise, (int, float)) and self.logit_noise >= 0):
            raise ValueError(f"logit_noise must be a number >= 0, got {self.logit_noise!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_NOISE_SALT = 0x1B873593


# seed_hash(KEYED_SEED) == 0 (fmix32 is a bijection that fixes 0), so with it the request ids alone key the draws.
KEYED_SEED = 0x9E3779B9


def request_keys(seed: int, request_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B]: seed_hash(seed) ^ id, each request's part of every draw's hash. The hash sees the seed and the id
    only through this xor, so sampling with these keys as the request ids and KEYED_SEED as the seed draws exactly
    what `seed` and the ids draw, bit for bit: the seed can then live in a device tensor, and one captured decode
    step serves every seed (an RL loop's per-step seeds)."""
    return (request_ids.long() & _M32) ^ seed_hash(seed)


def keep_mask(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """[B, V] bool of the tokens top-k / top-p keep (None when both keep everything).

    Row by row, the same bits whatever the batch: ties at the top-k threshold
    are kept; top-p sorts the tempered probabilities (stable, so ties go by
    token id; a sort only permutes) and keeps each token whose preceding mass,
    summed by `row_cumsum` in one fixed order, is below top_p, so the most
    likely token is always kept. With both, top-p cuts the distribution top-k
    left, renormalised (vLLM's and Hugging Face's definition): its normaliser
    is the logsumexp of the kept logits alone.
    """
    if params.top_k == 0 and params.top_p >= 1.0:
        return None
    x = logits.float()
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k:
        kth = torch.topk(x, min(params.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        keep &= x >= kth
    if params.top_p < 1.0:
        t = params.temperature if params.temperature > 0 else 1.0
        kept = logits.masked_fill(~keep, float("-inf")) if params.top_k else logits
        probs = torch.exp(x / t - logsumexp(kept, t)[..., None]) * keep
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # Our own scan: a library cumsum may change algorithm with the batch shape (one row vs many).
        before = row_cumsum(sorted_p) - sorted_p
        keep_sorted = before < params.top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def sample(logits: torch.Tensor, params: SamplingParams, request_ids: torch.Tensor,
           positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], raw log-probs [B], sampled log-probs [B]) from next-token logits [B, V]."""
    if params.logit_noise:
        # Elementwise from hashes of (seed, request, position, v): batch-invariant, the same on any device.
        z = torch.special.ndtri(uniforms(params.seed, request_ids, positions, logits.shape[-1], _NOISE_SALT))
        logits = logits.float() + params.logit_noise * z
    keep = keep_mask(logits, params)
    if params.greedy:
        x = logits.float() if keep is None else logits.float().masked_fill(~keep, float("-inf"))
        tokens = torch.argmax(x, dim=-1)
    elif logits.device.type == "cuda" or interpreting():
        tokens = gumbel_argmax(logits, params.temperature, params.seed, request_ids, positions, keep)
    else:
        u = uniforms(params.seed, request_ids, positions, logits.shape[-1])
        tokens = gumbel_argmax_reference(logits, params.temperature, u, keep)
    raw = token_logprobs(logits, tokens)
    if keep is None and params.temperature == 1.0:
        # The sampled distribution is the raw one: the same call again would give these bits (x / 1 is x), and
        # skipping it saves a pass over [B, V] logits a decode step (one of three, at the common RL setting).
        return tokens, raw, raw
    return tokens, raw, sampled_logprobs(logits, tokens, params, keep)


def sampled_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of `tokens` in the tempered, truncated distribution `params` samples from."""
    if params.greedy:
        return torch.zeros(tokens.shape, device=logits.device, dtype=torch.float32)
    if keep is None:
        keep = keep_mask(logits, params)
    masked = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
    return token_logprobs(masked, tokens, params.temperature)

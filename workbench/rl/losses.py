"""The GRPO family: advantages, the policy-gradient losses, their aggregation, KL estimators and
off-policy corrections. Pure tensor functions; every one has a hand-computed test.

The tensor contract, one for every function here: B sequences, T completion positions (column t is
the t-th completion token of its sequence, right-padded; no prompt positions); `mask` [B, T] is 1 on
real completion tokens. Log-probs are fp32 [B, T]:
- `logp`: the policy being trained (with gradient);
- `old_logp`: the PPO ratio's denominator, no gradient. The trainer's `old_logprobs` setting picks it:
  `recompute`, the trainer's own kernels on the weights that sampled (computed once, before the first
  update), or `sampler`, the generator's log-probs, as most vLLM-based trainers use them. In `invariant`
  mode the two are the same bits, so the ratio of the first mini-batch is exactly 1; in `standard` mode
  `sampler` puts the kernel mismatch into the ratio (and its clipping), `recompute` keeps it out of the
  ratio and leaves it to the off-policy corrections (`importance_weights`, old vs the sampler).

A loss cut into micro-batches is the sum of its micro-batches' losses when each gets the whole update's
`Totals` (its numbers of sequences and tokens): the normalisation is over the update, not per piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Totals:
    """The denominators of an update's loss: its sequences and real completion tokens (all micro-batches)."""

    sequences: int
    tokens: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> Totals:
        return cls(mask.shape[0], int(mask.sum()))


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sequence advantages from rewards [B] laid out group after group (B = groups x group_size).

    A = r - mean(group) (Dr.GRPO), divided by the group's sample standard deviation + eps when
    `scale` (GRPO). A group whose rewards are all equal gets zeros.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (advantages compare samples of one prompt), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: float | None = None,
              totals: Totals | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    - token-mean: sum over every real token / number of real tokens (DAPO);
    - seq-mean-token-mean: each sequence's token mean, then the mean over sequences (GRPO);
    - seq-mean-token-sum-norm: sum over every real token / (B * norm), norm a constant such as the
      largest completion length (Dr.GRPO).
    The counts are `totals` (a micro-batch's share of its update), by default this tensor's own.
    """
    m = mask.to(per_token.dtype)
    totals = totals or Totals.of(mask)
    if mode == "token-mean":
        return (per_token * m).sum() / max(totals.tokens, 1)
    if mode == "seq-mean-token-mean":
        return ((per_token * m).sum(1) / m.sum(1).clamp_min(1.0)).sum() / max(totals.sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        if not norm or norm <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive constant `norm` "
                             "(e.g. the max completion length)")
        return (per_token * m).sum() / (max(totals.sequences, 1) * norm)
    raise ValueError(f"unknown aggregation {mode!r}; choose one of {AGGREGATIONS}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3).

    With log r = ref_logp - logp: k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2
    (biased, low variance), k3 = r - 1 - log r (unbiased, never negative).
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; choose k1, k2 or k3")


def importance_weights(old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, level: str,
                       mode: str, cap: float) -> torch.Tensor:
    """Off-policy correction weights [B, T] for rollouts sampled by a behavior policy (the generator)
    that is not exactly the trainer's old policy: w = pi_old / mu, per token or per sequence
    (the product over the sequence's tokens), truncated at `cap` (TIS) or masked to zero outside
    [1/cap, cap]. With bitwise parity w is exactly 1 and this changes nothing."""
    if cap <= 1:
        raise ValueError(f"importance-weight cap must be > 1, got {cap}")
    log_w = (old_logp - behavior_logp) * mask
    if level == "sequence":
        log_w = log_w.sum(1, keepdim=True).expand_as(old_logp)
    elif level != "token":
        raise ValueError(f"importance-weight level must be 'token' or 'sequence', got {level!r}")
    w = torch.exp(log_w)
    if mode == "truncate":
        return w.clamp(max=cap)
    if mode == "mask":
        return torch.where((w <= cap) & (w >= 1.0 / cap), torch.ones_like(w), torch.zeros_like(w))
    raise ValueError(f"importance-weight mode must be 'truncate' or 'mask', got {mode!r}")


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    """Lower clip: the ratio is kept above 1 - eps_low."""
    eps_high: float = 0.2
    """Upper clip: the ratio is kept below 1 + eps_high (DAPO's clip-higher raises it)."""
    aggregation: str = "seq-mean-token-mean"
    """How the per-token loss becomes a scalar (see `aggregate`)."""
    norm: float | None = None
    """The constant of seq-mean-token-sum-norm (e.g. max completion length)."""


def _mean(total: torch.Tensor, count: int) -> torch.Tensor:
    """total / count by a true division (CUDA divides by a Python number through its reciprocal: 82 x (1/82)
    is 0.99999994, and a ratio that is exactly 1 on every token must average to exactly 1)."""
    return total / torch.tensor(float(max(count, 1)), dtype=total.dtype, device=total.device)


def _clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig):
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    # Clip fractions: the clipped branch is active (it is the smaller) at the low or the high edge.
    low = (ratio < 1.0 - cfg.eps_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.eps_high) & (adv > 0)
    return loss, low, high


def token_ppo_loss(logp, old_logp, adv, mask, cfg: LossConfig, weights=None, totals: Totals | None = None):
    """PPO-clip on per-token ratios (GRPO, Dr.GRPO, DAPO): returns (loss, stats).
    `weights` [B, T] (off-policy corrections) multiply the per-token loss. Stats are token means over
    `totals` (so micro-batches' stats add up to the update's)."""
    totals = totals or Totals.of(mask)
    ratio = torch.exp(logp - old_logp)
    loss, low, high = _clipped_pg(ratio, adv[:, None].expand_as(ratio), cfg)
    if weights is not None:
        loss = loss * weights
    m = mask.bool()
    n = totals.tokens
    stats = {"ratio_mean": _mean((ratio * m).sum(), n), "clip_low": _mean((low & m).sum().float(), n),
             "clip_high": _mean((high & m).sum().float(), n)}
    return aggregate(loss, mask, cfg.aggregation, cfg.norm, totals), stats


def sequence_ppo_loss(logp, old_logp, adv, mask, cfg: LossConfig, weights=None, totals: Totals | None = None):
    """GSPO: one ratio per sequence, exp(mean over its tokens of logp - old_logp), clipped per sequence,
    the sequences' losses averaged over `totals.sequences`. `weights` [B, T] are sequence-level
    (`importance_weights(level='sequence')`, one value per row): each sequence's loss is multiplied by
    their mean over its real tokens."""
    totals = totals or Totals.of(mask)
    m = mask.to(logp.dtype)
    n = m.sum(1).clamp_min(1.0)
    log_ratio = ((logp - old_logp) * m).sum(1) / n
    ratio = torch.exp(log_ratio)
    loss, low, high = _clipped_pg(ratio, adv, cfg)
    if weights is not None:
        loss = loss * (weights * m).sum(1) / n
    s = totals.sequences
    stats = {"ratio_mean": _mean(ratio.sum(), s), "clip_low": _mean(low.float().sum(), s),
             "clip_high": _mean(high.float().sum(), s)}
    return loss.sum() / max(s, 1), stats


@dataclass(frozen=True)
class LossSpec:
    fn: Callable
    """(logp, old_logp, advantages, mask, LossConfig, weights=None, totals=None) -> (loss, stats)."""
    scale_advantages: bool
    """Divide advantages by the group's standard deviation."""
    defaults: LossConfig
    """The published settings."""


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(token_ppo_loss, True, LossConfig(0.2, 0.2, "seq-mean-token-mean")),
    "dr_grpo": LossSpec(token_ppo_loss, False, LossConfig(0.2, 0.2, "seq-mean-token-sum-norm")),
    "dapo": LossSpec(token_ppo_loss, True, LossConfig(0.2, 0.28, "token-mean")),
    "gspo": LossSpec(sequence_ppo_loss, True, LossConfig(3e-4, 4e-4, "seq-mean-token-mean")),
}


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name]

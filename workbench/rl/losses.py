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


ADVANTAGE_SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-6,
                     penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence advantages from rewards [B] laid out group after group (B = groups x group_size).

    A = r - mean(group), divided by (`scale`):
    - 'group': the group's sample standard deviation + eps (GRPO); a group whose rewards are all equal
      gets zeros;
    - 'batch': the whole batch's sample standard deviation, when it exceeds 1e-8 (the vLLM + TorchTitan
      blog's `simple_rl.py` normalises the batch's rewards to mean 0, std 1, then subtracts each group's
      mean: the batch mean cancels, which leaves this);
    - 'none': nothing (Dr.GRPO).

    `penalty` [B] (the KL in the reward: kl_coef x each sequence's KL) is centred per group and subtracted
    after the scaling: A = (r - mean r) / spread(r) - (penalty - mean penalty). The spread is the task
    rewards' alone. Were the penalty part of the reward before the scaling, a group whose task rewards are
    all equal (most groups once a task is solved, or never) would divide KL differences of ~1e-4 by their
    own ~1e-4 std and hand out advantages of ~1, as large as a success. With scale 'none' both orders agree.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 (advantages compare samples of one prompt), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    if penalty is not None and penalty.shape != rewards.shape:
        raise ValueError(f"penalty must have the rewards' shape {tuple(rewards.shape)}, got {tuple(penalty.shape)}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    r = rewards.float().view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch" and r.numel() > 1:
        std = r.flatten().std()
        adv = torch.where(std > 1e-8, adv / std, adv)
    if penalty is not None:
        k = penalty.float().view(-1, group_size)
        adv = adv - (k - k.mean(dim=1, keepdim=True))
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


KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1, k2, k3).

    With log r = ref_logp - logp: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r.

    In the reward only the value counts: k1 and k3 are unbiased (k3 is never negative and has the lower
    variance: the reward's default), k2 is biased. In the loss the gradient counts, and the gradient of an
    unbiased estimate of the KL is not an estimate of the KL's gradient. With tokens x ~ pi:
    - grad k1 = grad log pi, whose expectation is 0: k1 in the loss penalises nothing (`TrainConfig` refuses it);
    - grad k2 = (log pi - log ref) grad log pi, whose expectation is grad KL(pi || ref): the loss's default;
    - grad k3 = (1 - r) grad log pi, whose expectation is -E_ref[grad log pi] = grad KL(ref || pi), the reverse
      KL's gradient (the GRPO paper's KL term).
    This holds for tokens of the policy being trained: an update's first mini-batch. Later mini-batches and
    epochs train on tokens of pi_old, which no estimator here reweights.
    """
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


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
    """Lower clip edge 1 - eps_low: below it a negative advantage pushes the ratio down no further (no gradient)."""
    eps_high: float = 0.2
    """Upper clip edge 1 + eps_high: above it a positive advantage pushes no further (DAPO's clip-higher raises it)."""
    aggregation: str = "seq-mean-token-mean"
    """How the per-token loss becomes a scalar (see `aggregate`)."""
    norm: float | None = None
    """The constant of seq-mean-token-sum-norm (e.g. max completion length)."""


def _mean(total: torch.Tensor, count: int) -> torch.Tensor:
    """total / count by a true division (CUDA divides by a Python number through its reciprocal: 82 x (1/82)
    is 0.99999994, and a ratio that is exactly 1 on every token must average to exactly 1). The divisor is
    filled on the device: `torch.tensor(count, device=...)` copies from pageable host memory, which waits for
    the whole queued forward before the backward can be launched."""
    return total / torch.full((), float(max(count, 1)), dtype=total.dtype, device=total.device)


def _clipped_pg(ratio: torch.Tensor, adv: torch.Tensor, cfg: LossConfig):
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    # Clip fractions: the clipped branch is active (it is the smaller) at the low or the high edge.
    low = (ratio < 1.0 - cfg.eps_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.eps_high) & (adv > 0)
    return loss, low, high


NUMERICS_BAND = 0.2
"""The band [1 - 0.2, 1 + 0.2] of `_outside_band`'s shares, whatever the loss's own clip (gspo's is 3e-4)."""


def _outside_band(logp, old_logp, mask, totals: Totals) -> dict[str, torch.Tensor]:
    """The share of tokens whose own ratio exp(logp - old) and of sequences whose summed ratio exp(sum logp - old)
    (the blog loss's) lie outside [1 - 0.2, 1 + 0.2], whatever the advantage's sign and the loss's clip: the part of
    a 0.2 trust region spent before any update (the frozen-policy probe, lr = 0: numerics alone). Logged by every
    loss, so the token and the sequence level are measured on the same ratios."""
    m = mask.to(logp.dtype)
    log_r = (logp - old_logp).detach()
    token, seq = torch.exp(log_r), torch.exp((log_r * m).sum(1))
    lo, hi = 1.0 - NUMERICS_BAND, 1.0 + NUMERICS_BAND
    token_out = ((token < lo) | (token > hi)) & mask.bool()
    return {"token_ratio_outside_0.2": _mean(token_out.sum().float(), totals.tokens),
            "seq_sum_ratio_outside_0.2": _mean(((seq < lo) | (seq > hi)).float().sum(), totals.sequences)}


def token_ppo_loss(logp, old_logp, adv, mask, cfg: LossConfig, weights=None, totals: Totals | None = None):
    """PPO-clip on per-token ratios (GRPO, Dr.GRPO, DAPO): returns (loss, stats).
    `weights` [B, T] (off-policy corrections) multiply the per-token loss. Stats, means over the tokens of
    `totals` (so micro-batches' stats add up to the update's): `ratio_mean`, and `clip_low` / `clip_high`, the
    shares of tokens whose clipped branch is active at the low / high edge."""
    totals = totals or Totals.of(mask)
    ratio = torch.exp(logp - old_logp)
    loss, low, high = _clipped_pg(ratio, adv[:, None].expand_as(ratio), cfg)
    if weights is not None:
        loss = loss * weights
    m = mask.bool()
    n = totals.tokens
    stats = {"ratio_mean": _mean((ratio * m).sum(), n), "clip_low": _mean((low & m).sum().float(), n),
             "clip_high": _mean((high & m).sum().float(), n), **_outside_band(logp, old_logp, mask, totals)}
    return aggregate(loss, mask, cfg.aggregation, cfg.norm, totals), stats


def _sequence_stats(ratio, low, high, totals: Totals) -> dict[str, torch.Tensor]:
    """A sequence-level loss's ratio and clip statistics, means over sequences, named apart from the token-level
    losses' token means (an ON/OFF table pooling both under one name would mix two quantities)."""
    s = totals.sequences
    return {"seq_ratio_mean": _mean(ratio.sum(), s), "seq_clip_low": _mean(low.float().sum(), s),
            "seq_clip_high": _mean(high.float().sum(), s)}


def sequence_ppo_loss(logp, old_logp, adv, mask, cfg: LossConfig, weights=None, totals: Totals | None = None):
    """GSPO: one ratio per sequence, exp(mean over its tokens of logp - old_logp), clipped per sequence,
    the sequences' losses averaged over `totals.sequences`. `weights` [B, T] are sequence-level
    (`importance_weights(level='sequence')`, one value per row): each sequence's loss is multiplied by
    their mean over its real tokens. Stats, means over the sequences of `totals`: `seq_ratio_mean`,
    `seq_clip_low` / `seq_clip_high` (the shares of sequences clipped at each edge)."""
    totals = totals or Totals.of(mask)
    m = mask.to(logp.dtype)
    n = m.sum(1).clamp_min(1.0)
    log_ratio = ((logp - old_logp) * m).sum(1) / n
    ratio = torch.exp(log_ratio)
    loss, low, high = _clipped_pg(ratio, adv, cfg)
    if weights is not None:
        loss = loss * (weights * m).sum(1) / n
    return loss.sum() / max(totals.sequences, 1), {**_sequence_stats(ratio, low, high, totals),
                                                   **_outside_band(logp, old_logp, mask, totals)}


BLOG_KL_COEF = 0.1
"""`simple_rl.py`'s kl_coef: the weight of mean(ratio - 1 - log ratio) over sequences."""
BLOG_ENTROPY_COEF = 0.01
"""`simple_rl.py`'s entropy_coef: the weight of the entropy bonus, the token mean of -log p."""


def blog_loss(logp, old_logp, adv, mask, cfg: LossConfig, weights=None, totals: Totals | None = None):
    """The loss of the vLLM + TorchTitan blog post's experiment (torchtitan `deterministic_vllm_rl/simple_rl.py`,
    `compute_policy_gradient_loss_vllm`), term for term:

        ratio = exp(sum_t logp - sum_t old_logp)                  one ratio per sequence, a SUM (GSPO: a mean)
        pg    = -mean_seq min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   (0.2, 0.2)
        kl    = mean_seq (ratio - 1 - log ratio)                  weight BLOG_KL_COEF
        bonus = -mean_tokens(-logp)                               weight BLOG_ENTROPY_COEF (all tokens of the step)
        loss  = pg + 0.1 * kl + 0.01 * bonus

    The sum makes the ratio's log the whole sequence's mismatch: with old = the sampler's log-probs, a
    sequence whose tokens each differ by 0.01 nats has a ratio of exp(0.01 x length) before any update.
    `weights` [B, T] (sequence-level corrections) multiply each sequence's pg term by their mean over its
    real tokens. Means are over `totals` (sequences for pg and kl, tokens for the bonus). Stats: those of
    `sequence_ppo_loss`, `seq_ratio_outside_clip` (the share of sequences whose ratio lies outside the clip range,
    whatever their advantage's sign) and `seq_kl` (the kl term's value).
    """
    totals = totals or Totals.of(mask)
    m = mask.to(logp.dtype)
    log_ratio = ((logp - old_logp) * m).sum(1)
    ratio = torch.exp(log_ratio)
    pg, low, high = _clipped_pg(ratio, adv, cfg)
    if weights is not None:
        pg = pg * (weights * m).sum(1) / m.sum(1).clamp_min(1.0)
    kl = ratio - 1.0 - log_ratio
    neg_logp = -(logp * m).sum()
    s = totals.sequences
    loss = (_mean(pg.sum(), s) + BLOG_KL_COEF * _mean(kl.sum(), s)
            - BLOG_ENTROPY_COEF * _mean(neg_logp, totals.tokens))
    outside = (ratio < 1.0 - cfg.eps_low) | (ratio > 1.0 + cfg.eps_high)
    stats = {**_sequence_stats(ratio, low, high, totals), "seq_ratio_outside_clip": _mean(outside.float().sum(), s),
             "seq_kl": _mean(kl.detach().sum(), s), **_outside_band(logp, old_logp, mask, totals)}
    return loss, stats


@dataclass(frozen=True)
class LossSpec:
    fn: Callable
    """(logp, old_logp, advantages, mask, LossConfig, weights=None, totals=None) -> (loss, stats)."""
    advantage_scale: str
    """What advantages are divided by: 'group' (its standard deviation), 'batch' or 'none' (`group_advantages`)."""
    defaults: LossConfig
    """The published settings."""
    sequence_level: bool = False
    """One ratio per sequence: corrections must be sequence-level too."""


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(token_ppo_loss, "group", LossConfig(0.2, 0.2, "seq-mean-token-mean")),
    "dr_grpo": LossSpec(token_ppo_loss, "none", LossConfig(0.2, 0.2, "seq-mean-token-sum-norm")),
    "dapo": LossSpec(token_ppo_loss, "group", LossConfig(0.2, 0.28, "token-mean")),
    "gspo": LossSpec(sequence_ppo_loss, "group", LossConfig(3e-4, 4e-4, "seq-mean-token-mean"), True),
    # Sequence-level: the loss's own terms are means over sequences (blog's entropy bonus a token mean); the
    # aggregation is only that of the trainer's KL term in the loss (`kl_coef`), and TrainConfig refuses another.
    "blog": LossSpec(blog_loss, "batch", LossConfig(0.2, 0.2, "token-mean"), True),
}


def get_loss(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name]

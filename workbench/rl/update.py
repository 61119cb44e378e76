"""The policy update on one step's rollouts: epochs x mini-batches x micro-batches.

Each epoch reshuffles the step's sequences (a permutation seeded by the run's seed, the step and the
epoch) and cuts them into `mini_batches` parts; each part is one AdamW step. A part is cut again into
micro-batches under the token budget; each micro-batch's loss gets the part's `Totals`, so the gradients
accumulated over the micro-batches are the gradient of the part's loss, normalised over the whole part.

The old log-probs, the correction weights and the KL target are computed once, before the first
update, over the whole step; from the second mini-batch on the ratio leaves 1 and the clip fractions
measure how far the policy moved.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from .config import TrainConfig
from .logprobs import completion_logprobs
from .losses import AGGREGATIONS, LossConfig, LossSpec, Totals, aggregate, kl_estimate
from .rollout import RolloutBatch
from .weights import TrainWeights


@dataclass
class UpdateInputs:
    """What the update reads besides the rollouts (all [B, T] in the completion layout, no gradient)."""

    advantages: torch.Tensor
    """[B] per-sequence advantages."""
    old: torch.Tensor
    """The PPO ratio's denominator (`old_logprobs`: the trainer's recomputation, or the sampler's)."""
    weights: torch.Tensor | None
    """Off-policy correction weights, or None."""
    kl_target: torch.Tensor | None
    """The log-probs the KL penalty pulls towards (reference or sampler), or None without a KL in the loss."""


def _mini_batches(n: int, cfg: TrainConfig, step: int, epoch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + epoch)
    return list(torch.randperm(n, generator=g).tensor_split(cfg.mini_batches))


def update(cfg: TrainConfig, spec: LossSpec, weights: TrainWeights, batch: RolloutBatch, inputs: UpdateInputs,
           step: int, on_bad_loss) -> dict[str, float]:
    """Train on the step's rollouts; returns the update's metrics, averaged over its optimizer steps.

    `on_bad_loss(loss)` is called (and must raise) when a micro-batch's loss is not finite, before that
    mini-batch's optimizer step.
    """
    base = spec.defaults
    norm = cfg.max_new_tokens if base.aggregation == AGGREGATIONS[2] else None
    loss_cfg = LossConfig(base.eps_low, base.eps_high, base.aggregation, norm)
    model = weights.model
    sums: dict[str, torch.Tensor | float] = defaultdict(float)
    sq_deltas: dict[str, float] = defaultdict(float)
    updates = 0
    for epoch in range(cfg.epochs):
        for part in _mini_batches(len(batch), cfg, step, epoch):
            totals = Totals(len(part), int(batch.mask[part.to(batch.device)].sum()))
            weights.zero_grad()
            # No host sync inside this loop (the losses and statistics stay on the device until the
            # optimizer step): a sync after each backward would leave the host launching the next
            # forward's many small kernels behind an idle GPU (~5% of an update at the 1.7B shape).
            losses = []
            for mb in batch.micro_batches(part, cfg.max_tokens_per_microbatch):
                logp, _ = completion_logprobs(model, mb, cfg.temperature, recompute=cfg.activation_checkpointing)
                cols = slice(0, mb.width)
                mask = batch.mask[mb.index, cols]
                w = None if inputs.weights is None else inputs.weights[mb.index, cols]
                loss, stats = spec.fn(logp, inputs.old[mb.index, cols], inputs.advantages[mb.index], mask,
                                      loss_cfg, w, totals)
                if inputs.kl_target is not None:
                    kl = kl_estimate(logp, inputs.kl_target[mb.index, cols], cfg.kl_estimator) * mask
                    loss = loss + cfg.kl_coef * aggregate(kl, mask, base.aggregation, norm, totals)
                    sums["kl"] += kl.detach().sum() / max(totals.tokens, 1)
                loss.backward()
                losses.append(loss.detach())
                for k, v in stats.items():
                    sums[k] += v.detach()
            losses = torch.stack(losses)
            finite = torch.isfinite(losses)
            if not bool(finite.all()):
                on_bad_loss(losses[~finite][0])
            sums["loss"] += losses.sum()
            result = weights.step()
            sums["grad_norm"] += result.pop("grad_norm")
            for k, v in result.items():
                sq_deltas[k] += v * v
            updates += 1
    out = {k: float(v) / updates for k, v in sums.items()}
    # Several optimizer steps: the root of their summed squared (relative) changes; the net change would need a
    # copy of the weights from before the first.
    out.update({k: math.sqrt(v) for k, v in sq_deltas.items()})
    out["optimizer_steps"] = updates
    return out

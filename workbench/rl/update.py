"""The policy update on one step's rollouts: epochs x mini-batches x micro-batches.

Each epoch reshuffles the step's sequences (seeded by the run's seed, the step and the epoch) and cuts them into
`mini_batches` parts, each one AdamW step; a part is cut again into micro-batches under the token budget, each
normalised by the part's `Totals`, so the accumulated gradient is the part's loss's. The old log-probs, correction
weights and KL target are computed once, before the first update; where the update's forward is the step's
scoring pass (`scoring.InUpdate`), it hands its log-probs to `scored` before the loss check and the optimizer
step. Data-parallel and FSDP2 (the same gradient as one process, up to the summation order): docs/distributed.md.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..distributed.data_parallel import DataParallel
from .config import TrainConfig
from .logprobs import completion_logprobs, packs
from .losses import LossSpec, Totals, aggregate, kl_estimate
from .rollout import RolloutBatch
from .weights import TrainWeights


@dataclass
class UpdateInputs:
    """What the update reads besides the rollouts (all [B, T] in the completion layout, no gradient)."""

    advantages: torch.Tensor
    """[B] per-sequence advantages."""
    old: torch.Tensor | None
    """The PPO ratio's denominator (`old_logprobs`: the trainer's recomputation, or the sampler's); None: the
    update's own forward, detached (with `scored`: `scoring.InUpdate`)."""
    weights: torch.Tensor | None
    """Off-policy correction weights, or None."""
    kl_target: torch.Tensor | None
    """The log-probs the KL penalty pulls towards (reference or sampler), or None without a KL in the loss."""


def _mini_batches(n: int, cfg: TrainConfig, step: int, epoch: int, rank: int = 0,
                  world: int = 1) -> list[tuple[int, torch.Tensor]]:
    """The epoch's mini-batches of the step's n * world sequences (rank r holds rows r * n .. (r + 1) * n - 1):
    per mini-batch its size and this rank's rows of it, as indices into the rank's n. The permutation depends on
    the seed, the step and the epoch only, so a mini-batch holds the same sequences at any world size."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + epoch)
    first = rank * n
    return [(len(part), part[(part >= first) & (part < first + n)] - first)
            for part in torch.randperm(n * world, generator=g).tensor_split(cfg.optim.mini_batches)]


def update(cfg: TrainConfig, spec: LossSpec, weights: TrainWeights, batch: RolloutBatch, inputs: UpdateInputs,
           step: int, on_bad_loss, dp: DataParallel | None = None, scored=None) -> dict[str, float]:
    """Train on the step's rollouts; returns the update's metrics, averaged over its optimizer steps (with `dp`:
    over the whole step, the same on every rank).

    `on_bad_loss(loss)` is called (and must raise) when a micro-batch's loss is not finite, before that
    mini-batch's optimizer step (with `dp`: on every rank, when any rank's loss is not finite).
    `scored(logp, entropy)`: the update's forward is the step's scoring pass (module docstring); it gets the [B, T]
    log-probs and entropies of this rank's rows before the loss check and the optimizer step, and may raise.
    """
    if scored is not None and (cfg.optim.epochs, cfg.optim.mini_batches, weights.sharded) != (1, 1, None):
        raise ValueError("the update's forward scores the step only in one epoch of one mini-batch, unsharded")
    if scored is None and inputs.old is None:
        raise ValueError("no old log-probs: give inputs.old, or score in the update (scored)")
    loss_cfg = cfg.loss_config()
    model = weights.module
    sums: dict[str, torch.Tensor | float] = defaultdict(float)
    sq_deltas: dict[str, float] = defaultdict(float)
    grad_norm = 0.0
    updates = 0
    place = (0, 1) if dp is None else (dp.rank, dp.world_size)
    plan = [_mini_batches(len(batch), cfg, step, epoch, *place) for epoch in range(cfg.optim.epochs)]
    # Each mini-batch's real tokens over every rank, for its loss's normalisation: one reduction per update.
    tokens = torch.stack([batch.mask[rows.to(batch.device)].sum() for parts in plan for _, rows in parts])
    tokens = iter((tokens if dp is None else dp.sum(tokens)).tolist())
    budget = cfg.optim.max_tokens_per_microbatch
    packed = cfg.optim.packed_sequences and packs(model)
    counts = None
    if scored is not None:   # the step's log-probs and entropies, 0 on padding (as `logprobs.score`'s)
        step_logp, step_entropy = torch.zeros_like(batch.mask), torch.zeros_like(batch.mask)
    if weights.sharded is not None:   # FSDP2: the same number of forwards and backwards on every rank
        counts = iter(dp.max([len(batch.row_groups(rows, budget, packed)) for parts in plan for _, rows in parts]))
    for parts in plan:
        for size, rows in parts:
            totals = Totals(size, int(next(tokens)))
            mbs = batch.micro_batches(rows, budget, packed)
            runs = len(mbs) if counts is None else int(next(counts))
            weights.zero_grad()
            # No host sync inside this loop (the losses and statistics stay on the device until the
            # optimizer step): a sync after each backward would leave the host launching the next
            # forward's many small kernels behind an idle GPU (~5% of an update at the 1.7B shape).
            losses = []
            # No micro-batch when this rank holds no row of the mini-batch (data-parallel): it adds zeros to the sum.
            for i, mb in enumerate(mbs):
                weights.before_backward(last=i == runs - 1)
                # The entropy (detached, for the log) changes no log-prob bit: linear_logprobs computes the lse
                # either way, and its backward gets no entropy gradient.
                logp, entropy = completion_logprobs(model, mb, cfg.rollout.temperature, with_entropy=scored is not None,
                                                    recompute=cfg.optim.activation_checkpointing)
                cols = slice(0, mb.width)
                if scored is not None:
                    step_logp[mb.index, cols], step_entropy[mb.index, cols] = logp.detach(), entropy
                old = logp.detach() if inputs.old is None else inputs.old[mb.index, cols]
                mask = batch.mask[mb.index, cols]
                w = None if inputs.weights is None else inputs.weights[mb.index, cols]
                loss, stats = spec.fn(logp, old, inputs.advantages[mb.index], mask, loss_cfg, w, totals)
                if inputs.kl_target is not None:
                    target = inputs.kl_target[mb.index, cols]
                    kl = kl_estimate(logp, target, cfg.objective.kl_estimator_used) * mask
                    loss = loss + cfg.objective.kl_coef * aggregate(kl, mask, loss_cfg.aggregation, loss_cfg.norm,
                                                                    totals)
                    # Logged: the KL's value by k3 (unbiased, never negative), whichever estimator the gradient needs.
                    sums["kl"] += (kl_estimate(logp.detach(), target, "k3") * mask).sum() / max(totals.tokens, 1)
                loss.backward()
                losses.append(loss.detach())
                for k, v in stats.items():
                    sums[k] += v.detach()
            for i in range(len(mbs), runs):   # FSDP2 only: this rank's row 0, its loss times zero
                weights.before_backward(last=i == runs - 1)
                filler = batch.micro_batches(torch.arange(1), budget, packed)[0]
                logp, _ = completion_logprobs(model, filler, cfg.rollout.temperature,
                                              recompute=cfg.optim.activation_checkpointing)
                (logp.sum() * 0.0).backward()
            if scored is not None:   # before the loss check, as the scoring pass came before the update
                scored(step_logp, step_entropy)
            losses = torch.stack(losses) if losses else batch.mask.new_zeros(0)
            if dp is None:
                finite = torch.isfinite(losses)
                bad = None if bool(finite.all()) else losses[~finite][0]
            else:  # every rank learns of it, so none is left waiting in the gradient sum
                bad = dp.first_non_finite(losses)
            if bad is not None:
                on_bad_loss(bad)
            sums["loss"] += losses.sum()
            if dp is not None and weights.sharded is None:   # FSDP2 reduced them in the last backward
                dp.all_reduce_grads(weights)
            result = weights.step()
            grad_norm += result.pop("grad_norm")   # of the summed gradient: the same on every rank
            for k, v in result.items():
                sq_deltas[k] += v * v
            updates += 1
    if dp is not None:   # each rank's sums are its share of the whole mini-batches' means
        names = sorted(sums)   # one order on every rank
        summed = dict(zip(names, dp.sum(torch.stack([sums[k] for k in names])).unbind()))
        sums = {k: summed[k] for k in sums}
    out = {k: float(v) / updates for k, v in sums.items()}
    out["grad_norm"] = grad_norm / updates
    # Several optimizer steps: the root of their summed squared (relative) changes; the net change would need a
    # copy of the weights from before the first.
    out.update({k: math.sqrt(v) for k, v in sq_deltas.items()})
    out["optimizer_steps"] = updates
    return out

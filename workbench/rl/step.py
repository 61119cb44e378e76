"""One RL step of a trainer rank (`train_step`), read top to bottom: sample -> reward -> score and parity check ->
advantages -> update (`update.py`) -> publish -> log. Where the samples come from (`samplers.py`) and how their
trainer log-probs are got and checked (`scoring.py`) are chosen once, at setup (`run.py`): the step has no branch
on either. Data-parallel, each rank does the step on its share of the prompts and gathers what needs the whole
step (docs/distributed.md).
"""

from __future__ import annotations

import time
import torch
import torch.distributed as dist

from ..distributed.broadcast import digest
from .checkpoint import last_good
from .logprobs import score
from .losses import LossSpec, get_loss, group_advantages, importance_weights, kl_estimate
from .rank import Rank
from .rollout import RolloutBatch
from .samplers import Rollout
from .scoring import ParityError, Scores
from .update import UpdateInputs, update

__all__ = ["ParityError", "train_step"]


def train_step(run: Rank, step: int) -> tuple[float, int]:
    """One sample -> reward -> score and parity check -> advantages -> update -> publish; metrics go to run.log.

    Data-parallel, each rank does it on its share of the step's prompts; what needs the whole step (the parity
    check, the advantages, the metrics) gathers every rank's rows, in rank order: the one-process batch.
    Returns (mean reward, tokens differing) for the progress bar.
    """
    t0 = time.perf_counter()
    rollout = run.sampler.sample(step)
    batch = _batch(run, rollout, step)
    t_gen = time.perf_counter()
    rewards, per_sequence = run.rewards(step, rollout, batch)
    scores = run.scoring.begin(step, rollout, batch)
    spec = get_loss(run.cfg.objective.loss)
    rewards_all, advantages, kl_target, later = _advantages(run, spec, rollout, batch, rewards, scores)
    stats = _update(run, spec, step, batch, advantages, kl_target, scores, later)
    t_train = time.perf_counter()
    run.sampler.publish(step, run.weights.model)
    t_sync = time.perf_counter()
    seconds = {"generate": t_gen - t0, "train": t_train - t_gen, "sync": t_sync - t_train + rollout.sync_s,
               "step": t_sync - t0, "score": scores.seconds, **rollout.seconds}
    _log(run, step, rollout, rewards_all, scores, per_sequence, {**later, **stats}, seconds)
    return rewards_all.mean().item(), scores.parity["tokens_differing"]


def _batch(run: Rank, rollout: Rollout, step: int) -> RolloutBatch:
    """The samples in the losses' layout (tensor parallel: checked to be the same bits on the group's ranks)."""
    batch = RolloutBatch.from_generation(rollout.prompts, rollout.completions, run.tok.pad_token_id or 0, run.device)
    if run.tp_mesh is not None:
        _same_in_group(run.tp_mesh, batch, step)
    return batch


def _advantages(run: Rank, spec: LossSpec, rollout: Rollout, batch: RolloutBatch, rewards: torch.Tensor,
                scores: Scores) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """(the whole step's rewards, this rank's advantages, the KL target or None, metrics for after the update).
    The KL in the reward, when asked, is a penalty subtracted after the task rewards' scaling (a zero penalty
    changes no bit: x - 0 is x)."""
    cfg, dp, mask = run.cfg, run.dp, batch.mask
    later = {}  # metrics logged once the update is known to be finite
    kl_target = None
    if cfg.objective.kl_coef > 0:
        kl_target = score(run.reference, batch, cfg.optim.max_tokens_per_microbatch, cfg.rollout.temperature)[0] \
            if run.reference is not None else batch.behavior
    penalty = torch.zeros_like(rewards)
    if kl_target is not None and cfg.objective.kl_in_reward:
        kl = kl_estimate(scores.logp, kl_target, cfg.objective.kl_estimator_used)
        penalty = cfg.objective.kl_coef * (kl * mask).sum(1)
        # Logged: the KL's value by k3, as in the loss path (update), whatever estimator the penalty uses.
        later["kl"] = dp.ratio_of_sums((kl_estimate(scores.logp, kl_target, "k3") * mask).sum(), mask.sum())
    # From the whole step's rewards ('batch' scales by all of them), then this rank's rows.
    rewards_all, penalty_all = dp.gather_rows(rewards, penalty)
    advantages = group_advantages(rewards_all, cfg.rollout.group_size, scale=spec.advantage_scale,
                                  penalty=penalty_all)[rollout.rows]
    return rewards_all, advantages, kl_target, later


def _update(run: Rank, spec: LossSpec, step: int, batch: RolloutBatch, advantages: torch.Tensor,
            kl_target: torch.Tensor | None, scores: Scores, later: dict) -> dict[str, float]:
    """The update on the step's rollouts, its replicas checked; returns its metrics."""
    cfg, dp, mask = run.cfg, run.dp, batch.mask
    old = scores.old(cfg.objective.old_logprobs, batch)
    is_weights = None  # the off-policy correction's, not the model's
    if cfg.objective.correction != "none":
        kind, level = cfg.objective.correction.split("-")
        is_weights = importance_weights(old, batch.behavior, mask, level, "truncate" if kind == "tis" else "mask",
                                        cfg.objective.correction_cap)
        later["is_weight_mean"] = dp.ratio_of_sums((is_weights * mask).sum(), mask.sum())
    inputs = UpdateInputs(advantages, old, is_weights, None if cfg.objective.kl_in_reward else kl_target)

    def bad_loss(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss.item()}; {last_good(run.out)}. "
                                 "Lower the learning rate or check the rewards.")

    stats = update(cfg, spec, run.weights, batch, inputs, step, bad_loss, dp, scores.in_update)
    dp.check_replicas(run.weights, step)   # every rank took the same step: the same bits, checked
    return stats


def _log(run: Rank, step: int, rollout: Rollout, rewards_all: torch.Tensor, scores: Scores,
         per_sequence: list[tuple], metrics: dict, seconds: dict) -> None:
    """The whole step's numbers (the slowest rank's times), so that rank 0's table describes the step."""
    log, dp = run.log, run.dp
    every = dp.gather_objects(per_sequence)
    scored, lengths, truncated, failed = (list(column) for column in zip(*every))
    seconds = dict(zip(seconds, dp.max(list(seconds.values()))))
    for name, value in metrics.items():
        log(step, name, value)
    log(step, "reward_mean", rewards_all.mean())
    log(step, "reward_std", rewards_all.std())
    log(step, "reward_positive", (rewards_all > 0).float().mean())   # the task's own accuracy: accuracy_<score>
    log(step, "reward_failures", sum(failed))
    for name in next((s for s in scored if s), {}):   # a failed completion's scores count 0
        log(step, f"accuracy_{name}", sum(s.get(name, 0.0) for s in scored) / len(scored))
    log(step, "entropy", dp.ratio_of_sums((scores.entropy * scores.checked).sum(), scores.checked.sum()))
    log(step, "response_length", sum(lengths) / len(lengths))
    log(step, "truncation_rate", sum(truncated) / len(lengths))
    log(step, "policy_lag", step - 1 - rollout.version)
    for name in ("generate", "train", "sync"):
        log(step, f"time_{name}", seconds[name])
    log(step, "sync_bytes", run.sampler.moved_bytes)
    for name in ("score", "rollout_wait", "trainer_wait", "overlap"):   # the last three: split roles only
        if name in seconds:
            log(step, f"time_{name}", seconds[name])
    log(step, "time_step", seconds["step"])
    log(step, "tokens_per_s", sum(lengths) / seconds["step"])


def _same_in_group(mesh, batch: RolloutBatch, step: int) -> None:
    """Tensor parallel: the group's ranks score and train one sharded model on one set of rows, so their rollouts
    must be the same bits (the same prompts, seeds and whole generators give them): rows that differed would be mixed
    in the sharded forward's gathers. A digest of each rank's tokens and log-probs, all-gathered and compared."""
    tokens = torch.tensor([t for c in batch.completions for t in c], dtype=torch.int64, device=batch.behavior.device)
    mine = digest([("tokens", tokens), ("behavior", batch.behavior)])
    every = [torch.empty_like(mine) for _ in range(mesh.size())]
    dist.all_gather(every, mine, group=mesh.get_group())
    bad = [r for r, d in enumerate(every) if not torch.equal(d, every[0])]
    if bad:
        raise RuntimeError(f"step {step}: the ranks of a tensor-parallel group sampled different rollouts (ranks "
                           f"{bad} of the group differ from its first) from the same prompts and seeds: a rank's "
                           "generator computed differently (another torch, triton or kernel mode, or a faulty GPU); "
                           "check those ranks before training on")

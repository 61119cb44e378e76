"""One RL step of a trainer rank (`train_step`), read top to bottom: rollout (the generator samples a group of
completions per prompt) -> reward -> the trainer's log-probs of the sampled tokens on the weights that sampled them,
checked against the generator's (the parity check) -> advantages -> update (epochs x mini-batches x
micro-batches, `update.py`) -> sync (the generator gets the new weights) -> the step's metrics.

Where the update's own forward computes those log-probs (`scores_in_update`: one epoch of one mini-batch on the
weights that sampled, in invariant mode), no separate scoring pass runs: the update's forward is the parity check's
side, the old policy and the logged entropy, and the check runs after its backward, before the optimizer step.

The parity check always compares the generator with the trainer's kernels on the generator's weights, so it
measures the kernel mismatch, never the policy lag. A separate pass may recompute a sample of the completions
(`parity_sample`, invariant mode: `parity_rows`); the rows it skips take the generator's log-probs, which are the
trainer's bits wherever the check looks, so the update is the same bits, and the parity and entropy metrics are
those of the rows checked. In `invariant` mode any difference stops the run
(parity='error'), unless `sampler_noise` perturbs the sampler on purpose (a dose-response run: the mismatch is then
its knob); in `standard` mode it is measured and logged. Step 1's per-token log-probs of both sides are kept
(step1_logprobs.npz), the starting policy's mismatch for histograms.

Data-parallel, each rank does the step on its share of the prompts and gathers what needs the whole step; with
tensor parallelism the ranks of one tensor-parallel group share one share (the same rollouts, scored and trained by
the sharded model's collectives). The run's setup and loop are `trainer.py`'s.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..distributed.broadcast import digest
from ..generation import SamplingParams, generate
from ..kernels import FUSED_ROWWISE, mode
from ..models import encode_prompt
from .checkpoint import last_good
from .config import TrainConfig
from .logprobs import parity_stats, save_token_logprobs, score
from .losses import get_loss, group_advantages, importance_weights, kl_estimate
from .rollout import RolloutBatch
from .update import UpdateInputs, update

if TYPE_CHECKING:
    from .run import Run


class ParityError(RuntimeError):
    """Generator and trainer log-probs differ in a run that claims bitwise parity."""


def sampler_kernels(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """The generator's kernels: the trainer's (the mode in force), or with sampler_kernels='engine' an inference
    engine's: the same standard products and decode attention, with the norms, SiLU and RoPE fused and rounded
    once (FUSED_ROWWISE), where the standard trainer runs Hugging Face's formulas with their bf16 round trips."""
    return mode("standard", **FUSED_ROWWISE) if cfg.sampler_kernels == "engine" else contextlib.nullcontext()


def step_prompts(run: Run, step: int) -> tuple[list, list[list[int]], SamplingParams, slice]:
    """This rank's share of the step: its problems, their prompts (each group_size times), the sampling settings,
    and its rows of the step."""
    cfg = run.cfg
    problems = run.task.problems(cfg.prompts_per_step, start=step * cfg.prompts_per_step)[run.share]
    prompts = [encode_prompt(run.tok, p.prompt, cfg.chat_template) for p in problems for _ in range(cfg.group_size)]
    sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                              stop_token_ids=(run.tok.eos_token_id,), seed=cfg.seed * 1_000_003 + step,
                              logit_noise=cfg.sampler_noise)
    return problems, prompts, sampling, slice(run.share.start * cfg.group_size, run.share.stop * cfg.group_size)


def train_step(run: Run, step: int) -> tuple[float, int]:
    """One rollout -> reward -> advantages -> update -> sync; metrics go to run.log.

    Data-parallel, each rank does it on its share of the step's prompts; what needs the whole step (the parity
    check, the advantages, the metrics) gathers every rank's rows, in rank order: the one-process batch.
    Returns (mean reward, tokens differing) for the progress bar.
    """
    cfg, log, model, sync, dp = run.cfg, run.log, run.weights.model, run.sync, run.dp
    spec = get_loss(cfg.loss)
    version = step - 1  # updates applied so far
    t0 = time.perf_counter()

    # Rollout: the generator samples with the weights of version gen_version.
    gen_version = sync.version
    problems, prompts, sampling, rows = step_prompts(run, step)
    # The step's row numbers as request ids: a completion's randomness is the same at any world size.
    ids = list(range(rows.start, rows.stop))
    sent = []   # split roles: the weight syncs to the rollout ranks during this step
    if run.pipeline is not None:   # split roles: the rollout ranks sampled the whole step; this rank takes its rows
        received = run.pipeline.receive(step)
        completions = received.items[rows]
        if received.version != gen_version or [c.prompt for c in completions] != prompts:
            raise RuntimeError(f"step {step}: the rollout ranks sampled with weights version {received.version} "
                               f"(this rank holds {gen_version} for the check), or other prompts than this rank's")
        t_received = time.perf_counter()
        # Policy lag k >= 1: step s + 1 samples with version s - k, which exists already (a kept copy): the rollout
        # ranks go on to the next step now, while this one trains. (At lag 0 it needs this step's update.)
        need = max(step - cfg.policy_lag, 0)
        if cfg.policy_lag:
            sent.append(run.pipeline.advance(step, model, need, sync.weights_of(need)))
    elif sync.engine is not None:
        completions = sync.engine.generate(prompts, sampling, request_ids=ids).completions
    else:
        with sampler_kernels(cfg):
            completions = generate(sync.sampler, prompts, sampling, request_ids=ids, keep=run.graphs).completions
    batch = RolloutBatch.from_generation(prompts, completions, run.tok.pad_token_id or 0, run.device)
    if run.tp_mesh is not None:
        _same_in_group(run.tp_mesh, batch, step)
    t_gen = time.perf_counter()

    # Reward.
    texts = [run.tok.decode(c, skip_special_tokens=True) for c in batch.completions]
    group = [problems[i // cfg.group_size] for i in range(len(texts))]
    batch_rewards = getattr(run.task, "rewards", None)  # the code task checks a batch in parallel, cached for scores
    rewards = torch.tensor(batch_rewards(texts, group) if batch_rewards else list(map(run.task.reward, texts, group)),
                           device=run.device)
    scores = [run.task.scores(t, p) for t, p in zip(texts, group)]

    # The trainer's log-probs on the weights that sampled: the parity check, and the old policy (split roles: the
    # rollout ranks computed them, with the trainer's forward, on those weights); or the update's forward does both.
    budget = cfg.max_tokens_per_microbatch
    folded = scores_in_update(run, gen_version, version)
    recomputed = entropy = parity = None
    scored_s = 0.0   # folded: the scoring is the update's forward, timed in time_train
    mask = batch.mask
    checked = mask   # the real tokens the parity check and the logged entropy cover: the rows recomputed
    if run.pipeline is not None:
        recomputed, entropy, rows_checked = _received_scores(cfg, step, received, rows, batch)
    elif not folded:
        rows_checked = parity_rows(cfg, step, range(rows.start, rows.stop))
        scorer = sync.generator if gen_version != version else run.weights.scorer
        t_score = time.perf_counter()
        recomputed, entropy = score(scorer, batch, budget, cfg.temperature, with_entropy=True,
                                    rows=None if all(rows_checked) else
                                    [i for i, ok in enumerate(rows_checked) if ok])
        if recomputed.is_cuda:   # the kernels run ahead of the host: their end, not their launch
            torch.cuda.synchronize(recomputed.device)
        scored_s = time.perf_counter() - t_score
    if not folded:
        if not all(rows_checked):   # a sample: the rows skipped take the generator's log-probs
            seen = torch.tensor(rows_checked, device=batch.device)[:, None]
            recomputed, checked = torch.where(seen, recomputed, batch.behavior), mask * seen
        parity = check_parity(run, step, batch, recomputed, checked)
    later = {}  # metrics logged once the update is known to be finite
    kl_target = None
    if cfg.kl_coef > 0:
        kl_target = score(run.reference, batch, budget, cfg.temperature)[0] if run.reference is not None \
            else batch.behavior

    # Advantages; the KL in the reward, when asked, is a penalty subtracted after the task rewards' scaling (a zero
    # penalty changes no bit: x - 0 is x).
    penalty = torch.zeros_like(rewards)
    if kl_target is not None and cfg.kl_in_reward:
        penalty = cfg.kl_coef * (kl_estimate(recomputed, kl_target, cfg.kl_estimator_used) * mask).sum(1)
        # Logged: the KL's value by k3, as in the loss path (update), whatever estimator the penalty uses.
        later["kl"] = dp.ratio_of_sums((kl_estimate(recomputed, kl_target, "k3") * mask).sum(), mask.sum())
    # From the whole step's rewards ('batch' scales by all of them), then this rank's rows.
    rewards_all, penalty_all = dp.gather_rows(rewards, penalty)
    advantages = group_advantages(rewards_all, cfg.group_size, scale=spec.advantage_scale, penalty=penalty_all)[rows]

    # Update.
    old = None if folded else recomputed if cfg.old_logprobs == "recompute" else batch.behavior
    is_weights = None  # the off-policy correction's, not the model's
    if cfg.correction != "none":
        kind, level = cfg.correction.split("-")
        is_weights = importance_weights(old, batch.behavior, mask, level, "truncate" if kind == "tis" else "mask",
                                        cfg.correction_cap)
        later["is_weight_mean"] = dp.ratio_of_sums((is_weights * mask).sum(), mask.sum())
    inputs = UpdateInputs(advantages, old, is_weights, None if cfg.kl_in_reward else kl_target)

    def bad_loss(loss):
        raise FloatingPointError(f"step {step}: the loss is {loss.item()}; {last_good(run.out)}. "
                                 "Lower the learning rate or check the rewards.")

    def scored(logp, ent):   # folded: the update's forward over the step, checked before its optimizer step
        nonlocal recomputed, entropy, parity
        recomputed, entropy = logp, ent
        parity = check_parity(run, step, batch, logp, mask)

    stats = update(cfg, spec, run.weights, batch, inputs, step, bad_loss, dp, scored if folded else None)
    dp.check_replicas(run.weights, step)   # every rank took the same step: the same bits, checked
    t_train = time.perf_counter()

    # Sync: the generator gets the weights it samples the next step with (split roles, policy lag 0: by broadcast
    # to the rollout ranks, which go on to the next step now).
    sync(step)
    if run.pipeline is not None:
        sent.append(run.pipeline.advance(step, model, step))
    t_sync = time.perf_counter()

    # The whole step's numbers (the slowest rank's times), so that rank 0's table describes the step.
    per_sequence = dp.gather_objects([(s, len(c), g.finish_reason == "length")
                                      for s, c, g in zip(scores, batch.completions, completions)])
    scores, lengths, truncated = (list(column) for column in zip(*per_sequence))
    seconds = {"generate": t_gen - t0, "train": t_train - t_gen, "sync": t_sync - t_train, "step": t_sync - t0}
    if run.pipeline is None:   # the part of `train` that scored the samples (the parity check's forward); 0 where
        seconds["score"] = scored_s   # the update's forward scored them (folded: that time is the update's)
    else:   # the rollout ranks' numbers came with the samples; this rank waited and synced
        seconds.update(generate=received.generate_s, score=received.score_s, rollout_wait=received.rollout_wait_s,
                       sync=t_sync - t_train + t_gen - t_received, trainer_wait=t_received - t0,
                       overlap=received.overlap_s)
    seconds = dict(zip(seconds, dp.max(list(seconds.values()))))
    for name, value in {**later, **stats}.items():
        log(step, name, value)
    log(step, "reward_mean", rewards_all.mean())
    log(step, "reward_std", rewards_all.std())
    log(step, "reward_positive", (rewards_all > 0).float().mean())   # the task's own accuracy: accuracy_<score>
    for name in scores[0]:
        log(step, f"accuracy_{name}", sum(s[name] for s in scores) / len(scores))
    log(step, "entropy", dp.ratio_of_sums((entropy * checked).sum(), checked.sum()))
    log(step, "response_length", sum(lengths) / len(lengths))
    log(step, "truncation_rate", sum(truncated) / len(lengths))
    log(step, "policy_lag", version - gen_version)
    log(step, "time_generate", seconds["generate"])
    log(step, "time_train", seconds["train"])
    log(step, "time_sync", seconds["sync"])
    log(step, "sync_bytes", sync.moved_bytes if run.pipeline is None else sum(r.bytes for r in sent if r))
    for name in ("score", "rollout_wait", "trainer_wait", "overlap"):   # the last three: split roles only
        if name in seconds:
            log(step, f"time_{name}", seconds[name])
    log(step, "time_step", seconds["step"])
    log(step, "tokens_per_s", sum(lengths) / seconds["step"])
    return rewards_all.mean().item(), parity["tokens_differing"]


def scores_in_update(run: Run, gen_version: int, version: int) -> bool:
    """Whether the update's forward can be this step's scoring pass: where it computes the same log-prob bits as the
    no-grad pass would, on the same weights, and nothing needs them before the update. Each exclusion says why."""
    cfg, weights = run.cfg, run.weights
    return (run.pipeline is None   # split roles: the rollout ranks scored the samples, beside the generation
            and gen_version == version   # a lagged generator: the check runs on its weights, not the trained ones
            # Standard mode: the training forward's products (q, k and v apart, where the no-grad forward packs
            # them) need not give the no-grad forward's bits, which the standard arm's parity statistics measure.
            and cfg.kernel_mode == "invariant"
            # A second mini-batch or epoch trains on moved weights: the old log-probs are the first one's weights'.
            and cfg.epochs == 1 and cfg.mini_batches == 1
            and cfg.old_logprobs == "recompute"   # 'sampler': the ratio divides by the generator's log-probs
            and not (cfg.kl_coef > 0 and cfg.kl_in_reward)   # the penalty needs them before the advantages
            # The correction weighs the old policy against the sampler over whole sequences of the [B, T] layout,
            # and its weights are logged over the step: computed per micro-batch, a sum's grouping could differ.
            and cfg.correction == "none"
            # FSDP2: the sharded module trains, the whole bf16 model scores (a sharded forward is a collective).
            and weights.scorer is weights.module)


def parity_rows(cfg: TrainConfig, step: int, rows) -> list[bool]:
    """Whether the parity check recomputes each of `rows` (row numbers of the step): 1 in cfg.parity_sample, the
    rows with (row + step) % n == 0, so each row of a block of n takes its turn (with n = group_size, one completion
    of every group); every row at step 1, the starting policy's whole mismatch (step1_logprobs.npz)."""
    n = cfg.parity_sample
    return [step == 1 or (r + step) % n == 0 for r in rows]


def _received_scores(cfg: TrainConfig, step: int, received, rows: slice,
                     batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Split roles: this rank's [B, T] trainer log-probs and entropies, and its rows checked, from the rollout ranks'
    scores (those of the whole step's rows checked, one after another); 0 on a row not checked, as `score`'s."""
    everyone = parity_rows(cfg, step, range(len(received.items)))
    numbers = [r for r, ok in enumerate(everyone) if ok]
    lengths = [len(received.items[r].tokens) for r in numbers]
    scored = [dict(zip(numbers, t.split(lengths))) for t in received.scored]

    def mine(side: dict) -> torch.Tensor:
        return batch.spread(torch.cat([side.get(r, torch.zeros(len(received.items[r].tokens)))
                                       for r in range(rows.start, rows.stop)]))
    return mine(scored[0]), mine(scored[1]), everyone[rows]


def check_parity(run: Run, step: int, batch: RolloutBatch, recomputed: torch.Tensor, checked: torch.Tensor) -> dict:
    """The parity check over the whole step (every rank's rows, gathered in rank order) on the tokens `checked` (the
    real tokens of the rows recomputed): its statistics logged, step 1's per-token log-probs saved, and in invariant
    mode a difference stops the run; returns the statistics."""
    cfg, log, dp = run.cfg, run.log, run.dp
    # Over the whole step: a break on any rank stops every rank, each raising the same error.
    behavior_all, recomputed_all, mask_all = dp.gather_rows(batch.behavior, recomputed, checked)
    parity = parity_stats(behavior_all, recomputed_all, mask_all)
    # Logged first, so the step that breaks parity is on record in metrics.csv.
    log(step, "parity_tokens_checked", parity["tokens"])
    log(step, "parity_max_abs_diff", parity["max_abs_diff"])
    log(step, "parity_mean_abs_diff", parity["mean_abs_diff"])
    log(step, "parity_tokens_differing", parity["tokens_differing"])
    log(step, "sampler_trainer_kl", parity["kl"])
    log(step, "is_ess", parity["ess"])
    log(step, "seq_logratio_sd", parity["seq_logratio_sd"])
    log(step, "seq_ratio_outside_1.2", parity["seq_ratio_outside_1.2"])
    if step == 1 and dp.is_main:  # the starting policy's per-token mismatch, for histograms
        save_token_logprobs(run.out / "step1_logprobs.npz", behavior_all, recomputed_all, mask_all)
    # With sampler_noise the mismatch is the experiment's own knob, measured above, not a broken kernel.
    if cfg.kernel_mode == "invariant" and not cfg.sampler_noise and parity["tokens_differing"]:
        msg = (f"step {step}: generator and trainer log-probs differ on {parity['tokens_differing']} of "
               f"{parity['tokens']} tokens (max |diff| {parity['max_abs_diff']:.3g}) in invariant mode")
        if cfg.parity == "error":
            raise ParityError(f"{msg}; {last_good(run.out)}. Check that no op runs in standard mode "
                              "(mode overrides) and that the generator and trainer share the weights.")
        if dp.is_main:
            print("warning:", msg)
    return parity


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

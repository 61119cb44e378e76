"""GRPO-family training with the generator and trainer on one model and one set of kernels.

Each step reads top to bottom: rollout (the generator samples a group of completions per prompt) ->
reward -> the trainer's log-probs of the sampled tokens on the weights that sampled them, checked
against the generator's (the parity check) -> advantages -> update (epochs x mini-batches x
micro-batches, `update.py`) -> sync (the generator gets the new weights, checked by checksum).

Synchronous by default (policy lag 0). With `policy_lag=k` the generator samples with the weights of
k updates before the trainer's, as an asynchronous pipeline would (`sync.py`). The parity check always
compares the generator with the trainer's kernels on the generator's weights, so it measures the kernel
mismatch, never the lag. In `invariant` mode any difference stops the run (parity='error'), unless
`sampler_noise` perturbs the sampler on purpose (a dose-response run: the mismatch is then its knob); in
`standard` mode it is measured and logged. Step 1's per-token log-probs of both sides are kept
(step1_logprobs.npz), the starting policy's mismatch for histograms.

With `adapter='lora'` the update trains LoRA adapters on a frozen base, the generator runs them unmerged, and
the sync moves the adapters only (docs/lora.md).

Metrics are a long table (step, metric, value, variant, seed), also sent to TensorBoard when asked.
On a failure (parity break, NaN loss) the metrics so far are still written before the error.

Under torchrun (`torchrun --nproc-per-node N -m workbench train ...`) the run is replicated data-parallel
(`workbench.distributed.data_parallel`): every rank holds the whole model, generates and trains on its share of
each step's prompts (whole groups), and takes the same optimizer step on the gradients summed over the ranks.
The parity check, the advantages and the metrics are over the whole step, so every rank takes the same
decisions; rank 0 alone writes files, in the same format as one process (docs/distributed.md). With
`parallel='fsdp2'` the trainer ranks shard the fp32 masters and AdamW's state with FSDP2 (`TrainWeights.sharded`),
the update's gradients stay fp32 into FSDP2's reduce-scatter, the bf16 model is gathered from the shards after each
update, and every trainer rank writes its shards of each checkpoint (DCP).

With `rollout_ranks = r > 0` the last r ranks only generate (`_serve`: a bf16 generator, no masters, no optimizer)
and the others only train (`workbench.distributed.pipeline`): the step's rollout is then the rollout ranks' samples
arriving, each with the weight version that drew them and the trainer's log-probs of its tokens (a rollout rank
runs the trainer's forward on the weights it sampled with: `score`, the same bits anywhere), and its sync a
broadcast to them. With a policy lag k >= 1 they generate the next step while this one trains; the trainer keeps
the last k + 1 versions (`WeightSync`) to send the older ones. In invariant mode the run is the one-process run,
bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..config import write_config
from ..distributed.data_parallel import DataParallel
from ..distributed.pipeline import Pipeline
from ..env import resolve_device
from ..files import make_folder
from ..generation import DecodeGraphs, SamplingParams, generate
from ..kernels import FUSED_ROWWISE, mode
from ..models import build, copy_weights, encode_prompt, load_pretrained, load_tokenizer, resolve_model, save_pretrained
from ..models.lora import base_state
from .checkpoint import last_good, latest_checkpoint, load_checkpoint, save_checkpoint, save_sharded_checkpoint
from .config import TrainConfig
from .logprobs import parity_stats, save_token_logprobs, score
from .losses import get_loss, group_advantages, importance_weights, kl_estimate
from .metrics import MetricsLog
from .policy import PolicyConfig, train_policy
from .rollout import RolloutBatch
from .sync import WeightSync
from .tasks import make_task
from .update import UpdateInputs, update
from .weights import TrainWeights


class ParityError(RuntimeError):
    """Generator and trainer log-probs differ in a run that claims bitwise parity."""


def _starting_policy(cfg: TrainConfig, out: Path, device: str, dp: DataParallel, generator_only: bool = False):
    # fp32 where it becomes the masters; a LoRA base is frozen in bf16 (the same bits as a cast of the fp32 load).
    # A rollout rank's generator is bf16 (its weights come from trainer rank 0's broadcast).
    masters = cfg.master_dtype == "float32" and cfg.adapter == "none" and not generator_only
    dtype = torch.float32 if masters else torch.bfloat16
    if cfg.policy:
        folder = resolve_model(cfg.policy)
        return load_pretrained(folder, dtype=dtype, device=device), load_tokenizer(folder)
    if cfg.task != "arithmetic":
        raise ValueError(f"task {cfg.task!r} needs a starting checkpoint (policy=...); the self-trained policy "
                         "only knows arithmetic")
    # Rank 0 trains it and saves it; the other ranks load that copy, for its shape and tokenizer (the weights
    # every rank starts from are rank 0's: `DataParallel.replicate`).
    trained = dp.on_main(lambda: train_policy(PolicyConfig(seed=cfg.seed, difficulty=cfg.difficulty, device=device),
                                              out / "policy", progress=cfg.progress)[:2])
    return trained or (load_pretrained(out / "policy", dtype=dtype, device=device), load_tokenizer(out / "policy"))


def _vllm_engine(cfg: TrainConfig, model, out: Path):
    """vLLM running the workbench model on the starting weights, in this process (generator='vllm')."""
    from ..generation.vllm_backend import VLLMGenerator

    save_pretrained(model, out / "vllm_start")
    return VLLMGenerator(out / "vllm_start", gpu_memory_utilization=cfg.vllm_memory,
                         batch_invariant=cfg.kernel_mode == "invariant", seed=cfg.seed, model_impl=cfg.vllm_model,
                         kernel_mode=cfg.kernel_mode)


def train_weights(start, cfg: TrainConfig, device: str, shard_group=None) -> TrainWeights:
    """The weights the update trains, from the fp32 (or bf16) `start`, on cfg.trainer_backend; `shard_group`: the
    FSDP2 trainer ranks."""
    if cfg.trainer_backend == "torchtitan":   # an optional extra: imported only when asked for
        from .titan_backend import TitanWeights

        return TitanWeights(start, cfg, device, shard_group)
    return TrainWeights(start, cfg.master_dtype, cfg.lr, device, cfg.weight_decay, cfg.max_grad_norm,
                        cfg.lora_config(), cfg.seed, shard_group)


class Run:
    """A training run's state: the weights, the generator's sync, the task, the metrics, this rank's place."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.device = resolve_device(cfg.device)
        self.world = DataParallel.join(self.device)   # one process without torchrun's variables
        # Split roles (rollout_ranks > 0): the ranks that train are a group of their own; a rollout rank has no dp.
        self.pipeline = Pipeline(self.world, cfg.rollout_ranks, cfg.policy_lag) if cfg.rollout_ranks else None
        self.dp = self.world if self.pipeline is None else self.pipeline.trainers
        # This rank's prompts of each step (to train on; on a rollout rank, to generate).
        self.share = (self.pipeline or self.dp).shard(cfg.prompts_per_step)
        if self.world.is_main:   # the only rank that writes the run's files
            make_folder(self.out)
        if cfg.parallel == "fsdp2" and not self.world.process.distributed:
            raise ValueError("parallel='fsdp2' shards the trainer over torchrun's processes: launch with torchrun "
                             "--nproc-per-node N, or set parallel='replicate' for one process")
        if cfg.generator == "vllm" and self.world.world_size > 1:
            raise ValueError("generator='vllm' under torchrun is not supported yet (one engine per rank, each "
                             "with its own process group): use generator='embedded', or run vLLM in one process")
        if cfg.generator == "vllm":
            from ..generation.vllm_backend import require_vllm

            require_vllm()  # before the starting policy is trained: say at once what is missing
        # Before any work: say it at once.
        last = latest_checkpoint(self.out)
        if cfg.resume and last is None:
            raise FileNotFoundError(f"resume: no checkpoint in {self.out / 'checkpoints'}; run without resume first")
        if not cfg.resume and last is not None:
            raise ValueError(f"{self.out} already holds a run (checkpoint {last}); continue it with resume=True "
                             "(--resume), or give another out_dir (or delete that one)")
        main = self.world.is_main
        if main:
            write_config(cfg, self.out / "config.yaml")
        self.log = MetricsLog(cfg.variant or cfg.kernel_mode, cfg.seed, self.out if main else None,
                              cfg.tensorboard and main)
        torch.manual_seed(cfg.seed)
        self.task = make_task(cfg.task, seed=cfg.seed, difficulty=cfg.difficulty, source=cfg.task_source,
                              question_field=cfg.question_field, answer_field=cfg.answer_field,
                              max_new_tokens=cfg.max_new_tokens)
        rollout_only = self.dp is None
        # The embedded generator's caches and graphs, across steps. Not with sync='checkpoint': it loads a new
        # generator model every step, so nothing would replay and the kept step would hold the old model.
        self.graphs = DecodeGraphs() if cfg.keep_graphs and cfg.sync != "checkpoint" else None
        start, self.tok = _starting_policy(cfg, self.out, self.device, self.world, rollout_only)
        if rollout_only:   # a generator, no masters, no optimizer
            self.generator = start
            return
        # An error from here on stops the rollout ranks too (they wait for their first order).
        with self.pipeline.stop_on_error() if self.pipeline else contextlib.nullcontext():
            self._trainer(start)

    def _trainer(self, start) -> None:
        """A trainer rank's state: the weights from `start`, the reference, a resumed run's, the generator's."""
        cfg, main = self.cfg, self.world.is_main
        fsdp2 = cfg.parallel == "fsdp2"
        if fsdp2:   # every rank cuts its shards from rank 0's fp32 start
            self.dp.broadcast_model(start)
        self.weights = train_weights(start, cfg, self.device, self.dp.process_group if fsdp2 else None)
        del start
        self.dp.replicate(self.weights)
        self.reference = None
        if cfg.kl_coef > 0 and cfg.kl_to == "reference":
            # With LoRA the start is the base (B = 0): the reference is the base without adapters.
            self.reference = build(self.weights.model.config, device=self.device, dtype=torch.bfloat16, seed=None)
            copy_weights(base_state(self.weights.model), self.reference)
        self.start_step, lagged, previous = 0, None, None
        if cfg.resume:   # every rank reads the same checkpoint (rank 0 wrote it)
            self.start_step, previous, lagged = load_checkpoint(self.out, self.weights, cfg, self.device)
        self.dp.check_replicas(self.weights, self.start_step)
        self.log.start(self.start_step + 1, previous)
        engine = _vllm_engine(cfg, self.weights.model, self.out) if cfg.generator == "vllm" else None
        # sync='checkpoint' goes through a folder of each rank's own.
        sync_root = self.out if main else self.out / f"rank-{self.dp.rank}"
        # Split roles at policy lag 0: the trainer's model is the sampling weights (the rollout ranks get them by
        # broadcast), so the trainer keeps no generator copy of its own, as one process with sync='shared'.
        sync_cfg = dataclasses.replace(cfg, sync="shared", rollout_ranks=0) if self.pipeline and not cfg.policy_lag \
            else cfg
        self.sync = WeightSync(sync_cfg, self.weights.model, sync_root, self.device, engine, lagged)
        self.sync(self.start_step)
        if self.pipeline:
            self.pipeline.start(self.sync.generator, self.sync.version, self.start_step + 1, cfg.steps)

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes it (the replicas are identical: today's format, resumable at any world size); FSDP2: every
        trainer rank writes its shards."""
        if self.weights.sharded is not None:
            save_sharded_checkpoint(self.out, step, self.weights, self.log.table(), self.cfg, self.sync.lagged)
            return
        self.dp.on_main(lambda: save_checkpoint(self.out, step, self.weights, self.log.table(), self.cfg,
                                                self.sync.lagged))


def train(cfg: TrainConfig) -> pd.DataFrame:
    """Run GRPO-family training; returns the long metrics table (also written to out_dir/metrics.csv).

    With `time_limit_s`, the run may stop early (checkpointed): the table then ends before cfg.steps."""
    start = time.perf_counter()
    fresh = not Path(cfg.out_dir).exists()
    try:
        run = Run(cfg)
    except BaseException:   # a bad setting found while setting up: leave no folder holding config.yaml alone
        if fresh and os.environ.get("RANK", "0") == "0":
            shutil.rmtree(cfg.out_dir, ignore_errors=True)
        raise
    if run.dp is None:
        return _serve(run)
    bar = tqdm(total=cfg.steps, initial=run.start_step, disable=not cfg.progress or not run.dp.is_main,
               desc=f"train ({cfg.variant or cfg.kernel_mode}, seed {cfg.seed})")
    try:
        with mode(cfg.kernel_mode), run.pipeline.stop_on_error() if run.pipeline else contextlib.nullcontext():
            for step in range(run.start_step + 1, cfg.steps + 1):
                reward, differing = train_step(run, step)
                bar.set_postfix(reward=f"{reward:.3f}", differing=differing)
                bar.update(1)
                # One decision for every rank, or the ranks that go on would wait for the others forever.
                out_of_time = bool(cfg.time_limit_s) and run.dp.any(time.perf_counter() - start > cfg.time_limit_s)
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time:
                    run.checkpoint(step)
                run.log.write()   # metrics.csv current after every step, also when the process is killed
                if out_of_time and step < cfg.steps:
                    if run.dp.is_main:
                        print(f"{cfg.out_dir}: time limit ({cfg.time_limit_s:.0f} s) reached after step {step} of "
                              f"{cfg.steps}; checkpointed, continue with resume=True")
                    break
            if run.pipeline:
                run.pipeline.end()
                run.pipeline.leave()
    finally:
        bar.close()
        table = run.log.close()
    return table


def interrupted(cfg: TrainConfig) -> str:
    """What an interrupted run kept, and how to go on: one line for the command line."""
    out = Path(cfg.out_dir)
    last = latest_checkpoint(out)
    if last is None:
        return f"nothing to resume: no checkpoint was written in {out} yet; run the same command again to start over"
    return (f"{last_good(out)}, the metrics up to now in {out / 'metrics.csv'}; continue with: python -m workbench "
            f"train --config {out / 'config.yaml'} --resume")


def _serve(run: Run) -> pd.DataFrame:
    """A rollout rank's run (split roles): it generates the steps trainer rank 0 orders, with the weights it sends.
    Returns an empty table: the metrics are the trainer ranks' (rank 0 writes them)."""
    cfg = run.cfg

    def sample(step: int) -> list:   # the completions' log-probs are host tensors: they travel pickled
        _, prompts, sampling, rows = _step_prompts(run, step)
        with _sampler_kernels(cfg):
            return generate(run.generator, prompts, sampling, request_ids=list(range(rows.start, rows.stop)),
                            keep=run.graphs).completions

    def rescore(completions: list) -> tuple[torch.Tensor, torch.Tensor]:   # the parity check's other side
        batch = RolloutBatch.from_generation([c.prompt for c in completions], completions, run.tok.pad_token_id or 0,
                                             run.device)
        real = batch.mask.bool()
        return tuple(t[real].cpu() for t in score(run.generator, batch, cfg.max_tokens_per_microbatch,
                                                  cfg.temperature, with_entropy=True))

    with mode(cfg.kernel_mode):
        run.pipeline.serve(run.generator, sample, rescore)
    run.pipeline.leave()
    return run.log.table()


def _sampler_kernels(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """The generator's kernels: the trainer's (the mode in force), or with sampler_kernels='engine' an inference
    engine's: the same standard products and decode attention, with the norms, SiLU and RoPE fused and rounded
    once (FUSED_ROWWISE), where the standard trainer runs Hugging Face's formulas with their bf16 round trips."""
    return mode("standard", **FUSED_ROWWISE) if cfg.sampler_kernels == "engine" else contextlib.nullcontext()


def _step_prompts(run: Run, step: int) -> tuple[list, list[list[int]], SamplingParams, slice]:
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
    problems, prompts, sampling, rows = _step_prompts(run, step)
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
        with _sampler_kernels(cfg):
            completions = generate(sync.generator, prompts, sampling, request_ids=ids, keep=run.graphs).completions
    batch = RolloutBatch.from_generation(prompts, completions, run.tok.pad_token_id or 0, run.device)
    t_gen = time.perf_counter()

    # Reward.
    texts = [run.tok.decode(c, skip_special_tokens=True) for c in batch.completions]
    group = [problems[i // cfg.group_size] for i in range(len(texts))]
    batch_rewards = getattr(run.task, "rewards", None)  # the code task checks a batch in parallel, cached for scores
    rewards = torch.tensor(batch_rewards(texts, group) if batch_rewards else list(map(run.task.reward, texts, group)),
                           device=run.device)
    scores = [run.task.scores(t, p) for t, p in zip(texts, group)]

    # The trainer's log-probs on the weights that sampled: the parity check, and the old policy (split roles: the
    # rollout ranks computed them, with the trainer's forward, on those weights).
    budget = cfg.max_tokens_per_microbatch
    if run.pipeline is not None:   # the whole step's tokens one after another: this rank's rows are one stretch
        tokens = [len(c.tokens) for c in received.items]
        first = sum(tokens[: rows.start])
        recomputed, entropy = (batch.spread(t[first: first + sum(tokens[rows])]) for t in received.scored)
    else:
        scorer = sync.generator if gen_version != version else run.weights.scorer
        recomputed, entropy = score(scorer, batch, budget, cfg.temperature, with_entropy=True)
    # Over the whole step: a break on any rank stops every rank, each raising the same error.
    behavior_all, recomputed_all, mask_all = dp.gather_rows(batch.behavior, recomputed, batch.mask)
    parity = parity_stats(behavior_all, recomputed_all, mask_all)
    # Logged first, so the step that breaks parity is on record in metrics.csv.
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
    mask = batch.mask
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
    old = recomputed if cfg.old_logprobs == "recompute" else batch.behavior
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

    stats = update(cfg, spec, run.weights, batch, inputs, step, bad_loss, dp)
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
    if run.pipeline is not None:   # the rollout ranks' numbers came with the samples; this rank waited and synced
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
    log(step, "entropy", dp.ratio_of_sums((entropy * mask).sum(), mask.sum()))
    log(step, "response_length", sum(lengths) / len(lengths))
    log(step, "truncation_rate", sum(truncated) / len(lengths))
    log(step, "policy_lag", version - gen_version)
    log(step, "time_generate", seconds["generate"])
    log(step, "time_train", seconds["train"])
    log(step, "time_sync", seconds["sync"])
    log(step, "sync_bytes", sync.moved_bytes if run.pipeline is None else sum(r.bytes for r in sent if r))
    for name in ("score", "rollout_wait", "trainer_wait", "overlap"):   # split roles only
        if name in seconds:
            log(step, f"time_{name}", seconds[name])
    log(step, "time_step", seconds["step"])
    log(step, "tokens_per_s", sum(lengths) / seconds["step"])
    return rewards_all.mean().item(), parity["tokens_differing"]

"""GRPO-family training with the generator and trainer on one model and one set of kernels: the run's setup
(`Run`), its loop (`train`) and a rollout rank's loop (`_serve`); one step is `step.py`'s `train_step` (rollout ->
reward -> parity check -> advantages -> update -> sync).

Synchronous by default (policy lag 0). With `policy_lag=k` the generator samples with the weights of
k updates before the trainer's, as an asynchronous pipeline would (`sync.py`).

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
update, and every trainer rank writes its shards of each checkpoint (DCP). With `tensor_parallel = t > 1`
(trainer_backend='torchtitan') the ranks form a (dp, tp) mesh: the t ranks of a tensor-parallel group generate the
same rollouts with whole generators, and score and train them on one model sharded over them (`titan.tp`); the
data parallelism above runs over the dp groups.

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
from ..distributed.data_parallel import DataParallel, tensor_parallel
from ..distributed.pipeline import Pipeline
from ..env import resolve_device
from ..files import make_folder
from ..generation import DecodeGraphs, generate
from ..kernels import mode
from ..models import build, copy_weights, load_pretrained, load_tokenizer, resolve_model, save_pretrained
from ..models.lora import base_state
from .checkpoint import last_good, latest_checkpoint, load_checkpoint, save_checkpoint, save_sharded_checkpoint
from .config import TrainConfig
from .logprobs import score
from .metrics import MetricsLog
from .policy import PolicyConfig, train_policy
from .rollout import RolloutBatch
from .step import ParityError, sampler_kernels, step_prompts, train_step
from .sync import WeightSync
from .tasks import make_task
from .weights import TrainWeights

__all__ = ["ParityError", "Run", "interrupted", "train", "train_step", "train_weights"]


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


def train_weights(start, cfg: TrainConfig, device: str, shard_group=None, tp_mesh=None) -> TrainWeights:
    """The weights the update trains, from the fp32 (or bf16) `start`, on cfg.trainer_backend; `shard_group`: the
    FSDP2 trainer ranks; `tp_mesh`: this rank's tensor-parallel group (torchtitan only)."""
    if cfg.trainer_backend == "torchtitan":   # an optional extra: imported only when asked for
        from .titan_backend import TitanWeights

        return TitanWeights(start, cfg, device, shard_group, tp_mesh)
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
        self.trainers = self.world if self.pipeline is None else self.pipeline.trainers
        """Every rank that trains (the decisions they take together: the time limit)."""
        self.tp_mesh = None
        """tensor_parallel > 1: this rank's tensor-parallel group (1-D mesh), whose ranks share their rows."""
        self.dp = self.trainers
        """The ranks that split each step's prompts (with tensor parallelism: one rank of each group)."""
        if cfg.tensor_parallel > 1:
            self.dp, self.tp_mesh = tensor_parallel(self.world, cfg.tensor_parallel)
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
        if fsdp2 or self.tp_mesh is not None:   # every rank cuts its shards from rank 0's fp32 start
            self.trainers.broadcast_model(start)
        self.weights = train_weights(start, cfg, self.device, self.dp.process_group if fsdp2 else None, self.tp_mesh)
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
        sync_root = self.out if main else self.out / f"rank-{self.world.rank}"
        # Split roles at policy lag 0: the trainer's model is the sampling weights (the rollout ranks get them by
        # broadcast), so the trainer keeps no generator copy of its own, as one process with sync='shared'.
        sync_cfg = dataclasses.replace(cfg, sync="shared", rollout_ranks=0) if self.pipeline and not cfg.policy_lag \
            else cfg
        self.sync = WeightSync(sync_cfg, self.weights.model, sync_root, self.device, engine, lagged)
        self.sync(self.start_step)
        if self.pipeline:
            self.pipeline.start(self.sync.generator, self.sync.version, self.start_step + 1, cfg.steps)

    def checkpoint(self, step: int) -> None:
        """Rank 0 writes it (the replicas are identical: today's format, resumable at any world size); FSDP2 or
        tensor parallel: every trainer rank writes its shards."""
        if self.weights.dcp is not None:
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
                late = time.perf_counter() - start > cfg.time_limit_s
                out_of_time = bool(cfg.time_limit_s) and run.trainers.any(late)
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
        _, prompts, sampling, rows = step_prompts(run, step)
        with sampler_kernels(cfg):
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

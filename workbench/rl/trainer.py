"""GRPO-family training with the generator and trainer on one model and one set of kernels: the run's loop
(`train`) and a rollout rank's loop (`_serve`); the run's setup is `run.py`'s `Run`, one step `step.py`'s
`train_step` (rollout -> reward -> parity check -> advantages -> update -> sync; where the update's forward is the
scoring pass, the parity check runs inside the update, before its optimizer step).

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
import json
import os
import shutil
import time
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..generation import generate
from ..kernels import mode
from ..rundir import RUN_FILES, claim, deferred_interrupt
from .checkpoint import last_good, latest_checkpoint
from .config import TrainConfig
from .logprobs import score
from .rollout import RolloutBatch
from .run import Run, train_weights
from .step import ParityError, parity_rows, sampler_kernels, step_prompts, train_step

__all__ = ["ParityError", "Run", "interrupted", "train", "train_step", "train_weights"]


def train(cfg: TrainConfig) -> pd.DataFrame:
    """Run GRPO-family training; returns the long metrics table (also written to out_dir/metrics.csv).

    With `time_limit_s`, the run may stop early (checkpointed): the table then ends before cfg.steps. out_dir is
    locked while the run writes into it (`rundir.claim`); one that holds a run is refused unless resumed."""
    out, main = Path(cfg.out_dir), os.environ.get("RANK", "0") == "0"
    # Rank 0 alone writes the run's files, so it alone claims the folder; every rank decides whether there is work.
    with claim(cfg.out_dir, "train", holds=RUN_FILES, resume=cfg.resume,
               resumable=lambda: latest_checkpoint(out) is not None) if main else contextlib.nullcontext() as folder:
        last = latest_checkpoint(out) if cfg.resume else None
        if last is not None and (at := json.loads((last / "state.json").read_text())["step"]) >= cfg.steps:
            if main:
                print(f"nothing to do: the run is at step {at} ({out}, steps={cfg.steps})", flush=True)
            return pd.read_csv(last / "metrics.csv")   # nothing trained, nothing written
        return _train(cfg, fresh=main and folder.created)


def _train(cfg: TrainConfig, fresh: bool) -> pd.DataFrame:
    start = time.perf_counter()
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
        with mode(cfg.kernel_mode), run.pipeline.stop_on_error() if run.pipeline else contextlib.nullcontext(), \
                deferred_interrupt(run.world.world_size == 1) as stop:   # ranks must stop at one step: one process
            for step in range(run.start_step + 1, cfg.steps + 1):
                reward, differing = train_step(run, step)
                bar.set_postfix(reward=f"{reward:.3f}", differing=differing)
                bar.update(1)
                # One decision for every rank, or the ranks that go on would wait for the others forever.
                late = time.perf_counter() - start > cfg.time_limit_s
                out_of_time = bool(cfg.time_limit_s) and run.trainers.any(late)
                if step % cfg.checkpoint_every == 0 or step == cfg.steps or out_of_time or stop.requested:
                    run.checkpoint(step)
                run.log.write()   # metrics.csv current after every step, also when the process is killed
                if stop.requested and step < cfg.steps:   # Ctrl-C: checkpointed at this step's end
                    raise KeyboardInterrupt
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
        again = f"delete {out}, then run" if out.exists() else "run"
        return f"nothing to resume: no checkpoint was written in {out} yet; {again} the same command to start over"
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

    def rescore(step: int, completions: list) -> tuple[torch.Tensor, torch.Tensor]:   # the parity check's side
        completions = [c for c, ok in zip(completions, parity_rows(cfg, step, [c.request_id for c in completions]))
                       if ok]
        if not completions:
            return torch.empty(0), torch.empty(0)
        batch = RolloutBatch.from_generation([c.prompt for c in completions], completions, run.tok.pad_token_id or 0,
                                             run.device)
        real = batch.mask.bool()
        return tuple(t[real].cpu() for t in score(run.generator, batch, cfg.max_tokens_per_microbatch,
                                                  cfg.temperature, with_entropy=True))

    with mode(cfg.kernel_mode):
        run.pipeline.serve(run.generator, sample, rescore)
    run.pipeline.leave()
    return run.log.table()

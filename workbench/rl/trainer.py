"""GRPO-family training with the generator and trainer on one model and one set of kernels: the run's loop
(`train`). The run's setup is `run.py`'s (a trainer rank, or with split roles a rollout rank that serves), one step
`step.py`'s `train_step`. Synchronous by default; `policy_lag=k` samples with the weights of k updates before the
trainer's (`sync.py`). On a failure (parity break, NaN loss) the metrics so far are still written before the error.
Several processes (data, tensor and pipeline parallel, FSDP2, split roles): docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from ..kernels import mode
from ..rundir import RUN_FILES, claim, deferred_interrupt
from .checkpoint import last_good, latest_checkpoint
from .config import TrainConfig
from .run import RolloutRank, TrainerRank, open_rank, train_weights
from .step import ParityError, train_step

__all__ = ["ParityError", "TrainerRank", "interrupted", "train", "train_step", "train_weights"]


def train(cfg: TrainConfig) -> pd.DataFrame:
    """Run GRPO-family training; returns the long metrics table (also written to out_dir/metrics.csv).

    With `time_limit_s`, the run may stop early (checkpointed): the table then ends before cfg.steps. out_dir is
    locked while the run writes into it (`rundir.claim`); one that holds a run is refused unless resumed."""
    out, main = Path(cfg.out_dir), os.environ.get("RANK", "0") == "0"
    # Rank 0 alone writes the run's files, so it alone claims the folder; every rank decides whether there is work.
    with claim(cfg.out_dir, "train", holds=RUN_FILES, resume=cfg.checkpoint.resume,
               resumable=lambda: latest_checkpoint(out) is not None) if main else contextlib.nullcontext() as folder:
        last = latest_checkpoint(out) if cfg.checkpoint.resume else None
        if last is not None and (at := json.loads((last / "state.json").read_text())["step"]) >= cfg.steps:
            if main:
                print(f"nothing to do: the run is at step {at} ({out}, steps={cfg.steps})", flush=True)
            return pd.read_csv(last / "metrics.csv")   # nothing trained, nothing written
        return _train(cfg, fresh=main and folder.created)


def _train(cfg: TrainConfig, fresh: bool) -> pd.DataFrame:
    start = time.perf_counter()
    try:
        run = open_rank(cfg)
    except BaseException:   # a bad setting found while setting up: leave no folder holding config.yaml alone
        if fresh and os.environ.get("RANK", "0") == "0":
            shutil.rmtree(cfg.out_dir, ignore_errors=True)
        raise
    if isinstance(run, RolloutRank):
        return run.serve()
    bar = tqdm(total=cfg.steps, initial=run.start_step, disable=not cfg.progress or not run.dp.is_main,
               desc=f"train ({cfg.variant or cfg.kernel_mode}, seed {cfg.seed})")
    try:
        with mode(cfg.kernel_mode), run.sampler.running(), \
                deferred_interrupt(run.world.world_size == 1) as stop:   # ranks must stop at one step: one process
            for step in range(run.start_step + 1, cfg.steps + 1):
                reward, differing = train_step(run, step)
                bar.set_postfix(reward=f"{reward:.3f}", differing=differing)
                bar.update(1)
                # One decision for every rank, or the ranks that go on would wait for the others forever.
                late = time.perf_counter() - start > cfg.checkpoint.time_limit_s
                out_of_time = bool(cfg.checkpoint.time_limit_s) and run.trainers.any(late)
                # Read once: a Ctrl-C that comes after the checkpoint decision (during the metrics' write) stops
                # at the next step's end, never before a checkpoint of the step it stops at.
                stopping = stop.requested
                if step % cfg.checkpoint.checkpoint_every == 0 or step == cfg.steps or out_of_time or stopping:
                    run.checkpoint(step)
                run.log.write()   # metrics.csv current after every step, also when the process is killed
                if stopping and step < cfg.steps:   # Ctrl-C: checkpointed at this step's end
                    raise KeyboardInterrupt
                if out_of_time and step < cfg.steps:
                    if run.dp.is_main:
                        print(f"{cfg.out_dir}: time limit ({cfg.checkpoint.time_limit_s:.0f} s) reached after step "
                              f"{step} of {cfg.steps}; checkpointed, continue with resume=True")
                    break
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

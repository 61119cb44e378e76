"""Running an ON/OFF experiment: every (arm, seed) run into its own folder of out_dir, resumable, in
pieces, several at once.

A run that finished is recorded (its folder's run.json: config and steps) and never run again; one cut
short (a time limit, a killed process) resumes from its checkpoint; a folder holding a run with other
settings is an error, never overwritten. So `on-off --arms ... --seeds ...` with the same out_dir adds to
and continues what is there, and `time_limit_min` splits an experiment over calls of a few minutes.

Several runs at once (`workers`) each get a process of their own ('spawn': CUDA and vLLM initialise per
process; vLLM's batch-invariant mode, once on, patches torch for the whole process, so vLLM runs always
get one). Their kernels are the same whatever else shares the GPU, so `invariant` runs keep their bits. On CUDA
they run under an MPS daemon of the call's own where `mps` allows (onoff/mps.py), side by side, not time-sliced.
On a host with several GPUs the `workers` slots are spread evenly over them, and each run takes a free slot's GPU
as its current device (a run stays on one GPU: they are independent).

out_dir/metrics.csv is the long table of every run in the folder (finished or not), out_dir/runs.csv
their status, out_dir/invocations.csv each call's wall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file

from ..config import flat_dict, write_config
from ..env import environment_record, resolve_device
from ..models.checkpoint import weights_checksum
from ..models.hub import resolve_model
from ..policies.selftrained import PolicyConfig, train_policy
from ..rl.checkpoint import config_changes, latest_checkpoint
from ..rl.config import TrainConfig
from ..rl.trainer import train
from ..rundir import claim, start_over
from .config import OnOffConfig
from .mps import mps_daemon


class RunFailed(RuntimeError):
    """A run of the experiment failed (the others went on; their metrics are written)."""


RECORD = "run.json"
"""Written into a run's folder when it has finished: its config and its number of steps."""
RUN_FOLDER = re.compile(r"(?P<arm>.+)-seed(?P<seed>\d+)")
"""A run's folder name in out_dir: its arm and seed."""


def starting_policy(cfg: OnOffConfig) -> str:
    """The checkpoint every run starts from: cfg.run.policy, or one trained (once) into out_dir/policy.

    A policy already there is reused only if it was trained with the same settings.
    """
    if cfg.run.policy:
        return cfg.run.policy
    folder = Path(cfg.out_dir) / "policy"
    policy_cfg = PolicyConfig(size=cfg.policy_size, difficulty=cfg.run.data.difficulty, max_steps=cfg.policy_steps,
                              target_accuracy=tuple(cfg.policy_accuracy), device=resolve_device(cfg.run.device))
    wanted = {k: v for k, v in asdict(policy_cfg).items() if k != "device"}
    wanted["target_accuracy"] = list(wanted["target_accuracy"])
    record = folder / "policy_config.json"
    if (folder / "model.safetensors").exists():
        saved = json.loads(record.read_text()) if record.exists() else None
        if saved != wanted:
            raise ValueError(f"{folder} holds a starting policy trained with other settings ({saved}, now {wanted}); "
                             "use another out_dir or pass policy=...")
        return str(folder)
    _, _, table = train_policy(policy_cfg, folder, progress=cfg.run.progress)
    table.to_csv(folder / "sft_metrics.csv", index=False)
    record.write_text(json.dumps(wanted, indent=1))
    return str(folder)


POLICY_RECORD = "starting_policy.json"
"""Beside config.yaml: the starting policy's path and the sha256 of its weights files."""


def record_policy(policy: str, out: Path) -> dict:
    """Write POLICY_RECORD for `policy` (a folder; a registry name or hub id is resolved through the model cache):
    arms run in other holds or sessions, each from its own copy of a warm start, join one cell only where the
    weights are the same bits (`regime_plan.assemble`), not just the same path: the checkpoints' own checksum of
    the tensors by name, whatever the files' layout."""
    path = Path(policy).expanduser()
    folder = path if path.is_dir() else resolve_model(policy)
    state = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    record = {"path": str(policy), "weights_sha256": weights_checksum(state)}
    (out / POLICY_RECORD).write_text(json.dumps(record, indent=1))
    return record


def run_status(run: TrainConfig) -> str:
    """'done', 'partial' (a checkpoint to resume from) or 'new'; a run there with other settings is an error."""
    folder = Path(run.out_dir)
    record = folder / RECORD
    last = latest_checkpoint(folder)
    if record.exists():
        saved = json.loads(record.read_text())
        _check_same(run, saved["config"], folder)
        if saved["steps"] >= run.steps:
            return "done"
        if last is None:
            raise ValueError(f"{folder} finished at {saved['steps']} steps and its checkpoints were deleted "
                             f"(keep_checkpoints=False): it cannot go on to {run.steps}; use another out_dir")
    if last is not None:
        _check_same(run, json.loads((last / "state.json").read_text())["config"], folder)
        return "partial"
    return "new"


def _check_same(run: TrainConfig, saved: dict, folder: Path) -> None:
    changed = config_changes(saved, run)
    if changed:
        raise ValueError(f"{folder} holds a run with other settings {changed} (saved, now); "
                         "use another out_dir for the experiment")


def execute(run: TrainConfig, deadline: float, keep_checkpoints: bool, first: bool = False) -> str:
    """Run or continue one run until it finishes or `deadline` (time.time() seconds; 0: none) passes.

    Returns 'done', 'stopped' (checkpointed at the deadline) or 'waiting' (the deadline passed before it began).
    A `first` run goes at least one step, so every call of a time-limited experiment makes progress.
    """
    remaining = deadline - time.time() if deadline else 0.0
    if deadline and remaining <= 0:
        if not first:
            return "waiting"
        remaining = 1e-3
    resume = latest_checkpoint(Path(run.out_dir)) is not None
    if not resume:   # a run stopped before its first checkpoint starts over (train refuses a folder holding one)
        start_over(run.out_dir)
    table = train(dataclasses.replace(run, resume=resume, time_limit_s=remaining))
    steps = int(table.step.max())
    if steps < run.steps:
        return "stopped"
    folder = Path(run.out_dir)
    tmp = folder / f".{RECORD}.tmp"
    tmp.write_text(json.dumps({"config": flat_dict(run), "steps": steps}, indent=1))
    os.replace(tmp, folder / RECORD)
    if not keep_checkpoints:
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return "done"


def worker_threads(workers: int) -> int:
    """CPU threads for each of `workers` run processes: OMP_NUM_THREADS where set, else the host's cores shared
    out, at least one. As torchrun (and `distributed.launch`): every spawned process otherwise starts a thread per
    core, so N runs on one host ask for N threads a core while their updates wait on the host to launch kernels. A
    GPU run's math is on the GPU, so its bits do not depend on this."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // workers))


def _execute_in_worker(run: dict, deadline: float, keep_checkpoints: bool, first: bool, gpus, threads: int) -> str:
    """One run in a fresh process, on `threads` CPU threads; with `gpus` (a queue of free GPU slots) on the GPU of
    the slot it takes. As the current device, not CUDA_VISIBLE_DEVICES: importing the kernels has initialised CUDA
    already (it decides between the GPU and the interpreter), after which that variable is no longer read."""
    torch.set_num_threads(threads)
    if gpus is None:
        return execute(TrainConfig(**run), deadline, keep_checkpoints, first)
    gpu = gpus.get()
    torch.cuda.set_device(gpu)
    try:
        return execute(TrainConfig(**run), deadline, keep_checkpoints, first)
    finally:
        gpus.put(gpu)


def _gpu_slots(stack: contextlib.ExitStack, spawn, workers: int, device: str):
    """A queue of `workers` GPU slots (device indices) spread evenly over the visible GPUs; None with fewer than
    two GPUs."""
    count = torch.cuda.device_count() if device == "cuda" else 0
    if count < 2:
        return None
    slots = stack.enter_context(spawn.Manager()).Queue()
    for i in range(workers):
        slots.put(i % count)
    return slots


def run_on_off(cfg: OnOffConfig) -> pd.DataFrame:
    """Every (arm, seed) run of cfg not finished yet; returns the long table of every run in out_dir (also
    out_dir/metrics.csv). A run that fails does not stop the others: the first failure is raised at the end,
    after the tables are written. out_dir is locked meanwhile: a second process is refused."""
    with claim(cfg.out_dir, "on-off"):
        return _run_on_off(cfg)


def _run_on_off(cfg: OnOffConfig) -> pd.DataFrame:
    started, t0 = datetime.datetime.now(), time.time()
    out = Path(cfg.out_dir)
    write_config(cfg, out / "config.yaml")
    policy = starting_policy(cfg)
    record_policy(policy, out)
    deadline = t0 + 60 * cfg.time_limit_min if cfg.time_limit_min else 0.0
    todo = [cfg.run_config(arm, seed, policy) for seed in cfg.seeds for arm in cfg.arms]
    todo = [run for run in todo if run_status(run) != "done"]
    results: dict[str, str] = {}
    failures: list[tuple[str, BaseException]] = []
    if cfg.workers == 1 and all(run.rollout.generator == "embedded" for run in todo):
        for i, run in enumerate(todo):
            try:
                results[run.out_dir] = execute(run, deadline, cfg.keep_checkpoints, first=i == 0)
            except Exception as e:  # noqa: BLE001  reported with the run's name below
                failures.append((run.out_dir, e))
    elif todo:
        quiet = [dataclasses.replace(run, progress=False) for run in todo]  # one bar per process would interleave
        spawn = multiprocessing.get_context("spawn")
        with contextlib.ExitStack() as stack:
            # First in, last out: the daemon outlives the pool's workers, which connect to it at their start.
            stack.enter_context(mps_daemon(cfg.mps, out, resolve_device(cfg.run.device), cfg.workers))
            gpus = _gpu_slots(stack, spawn, cfg.workers, resolve_device(cfg.run.device))
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=cfg.workers, mp_context=spawn,
                                                           max_tasks_per_child=1))
            futures = {pool.submit(_execute_in_worker, flat_dict(run), deadline, cfg.keep_checkpoints,
                                   i < cfg.workers, gpus, worker_threads(cfg.workers)): run.out_dir
                       for i, run in enumerate(quiet)}
            for future in as_completed(futures):
                name = futures[future]
                try:
                    results[name] = future.result()
                except Exception as e:  # noqa: BLE001
                    failures.append((name, e))
                if cfg.run.progress:
                    print(f"{Path(name).name}: {results.get(name, 'FAILED')}", flush=True)
    table = collect(out)
    _log_invocation(out, started, time.time() - t0, results, failures)
    if failures:
        name, error = failures[0]
        raise RunFailed(f"run {Path(name).name} failed ({len(failures)} of {len(todo)} runs failed; the others' "
                          f"metrics are in {out / 'metrics.csv'}): {error}{_advice(failures, cfg.workers)}") \
            from error
    return table


def _advice(failures: list[tuple[str, BaseException]], workers: int) -> str:
    """What to do when runs sharing one GPU ran out of its memory: each worker process keeps its own CUDA cache."""
    oom = [name for name, e in failures if "out of memory" in str(e).lower()]
    if not oom or workers == 1:
        return ""
    return (f". {len(oom)} run(s) ran out of GPU memory with {workers} workers sharing the device: run the same "
            f"command again with fewer workers (e.g. workers={max(1, workers // 2)}); finished runs are kept and the "
            "others continue from their last checkpoint")


def collect(out: Path) -> pd.DataFrame:
    """The long table of every run folder in `out` (finished or not), written atomically to out/metrics.csv,
    and their status to out/runs.csv."""
    tables, status = [], []
    for folder in sorted(p for p in out.iterdir() if p.is_dir() and RUN_FOLDER.fullmatch(p.name)):
        path = folder / "metrics.csv"
        if not path.exists() or path.stat().st_size == 0:
            continue
        t = pd.read_csv(path)
        tables.append(t)
        record = folder / RECORD
        target = json.loads(record.read_text())["config"]["steps"] if record.exists() else None
        status.append({"run": folder.name, "variant": t.variant.iloc[0] if len(t) else "",
                       "seed": int(RUN_FOLDER.fullmatch(folder.name)["seed"]),
                       "steps_done": int(t.step.max()) if len(t) else 0, "finished": record.exists(),
                       "steps": target})
    table = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(
        columns=["step", "metric", "value", "variant", "seed"])
    _write_atomic(table, out / "metrics.csv")
    _write_atomic(pd.DataFrame(status), out / "runs.csv")
    return table


def finished_runs(table: pd.DataFrame, out: Path) -> pd.DataFrame:
    """The rows of `table` from runs recorded as finished in out/runs.csv (a cut-short run biases endpoints)."""
    runs = pd.read_csv(out / "runs.csv")
    done = runs[runs.finished.astype(bool)][["variant", "seed"]]
    return table.merge(done, on=["variant", "seed"])


def total_wall_s(out: Path) -> float:
    """The summed wall time of every call that ran into `out`."""
    path = out / "invocations.csv"
    return float(pd.read_csv(path).wall_s.sum()) if path.exists() else 0.0


def _log_invocation(out: Path, started, wall_s: float, results: dict, failures: list) -> None:
    env = environment_record()
    row = pd.DataFrame([{"started": started.isoformat(timespec="seconds"), "wall_s": round(wall_s, 1),
                         "device": env.get("gpu") or "CPU", "git_sha": env.get("git_sha"),
                         "done": sum(r == "done" for r in results.values()),
                         "stopped": sum(r == "stopped" for r in results.values()),
                         "waiting": sum(r == "waiting" for r in results.values()), "failed": len(failures)}])
    path = out / "invocations.csv"
    _write_atomic(pd.concat([pd.read_csv(path), row]) if path.exists() else row, path)


def _write_atomic(table: pd.DataFrame, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    table.to_csv(tmp, index=False)
    os.replace(tmp, path)

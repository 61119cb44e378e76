"""Issue 17 on one host with 2 GPUs: the weight broadcast, and RL steps on one GPU against two, colocated and with
split roles, synchronous and asynchronous, each figure beside its baseline measured in the same run.

1. **Broadcast** (2 processes): the trainer's bf16 weights at --shape from rank 0 to rank 1 with
   `broadcast.broadcast_weights` (buckets, double-buffered, then the digest check), beside one raw NCCL
   `dist.broadcast` of the same bytes as one flat buffer (the link's own speed: the baseline), and the floor at the
   link's nominal bandwidth (--link-gbs).
2. **RL steps** through `workbench.rl.trainer.train` on a random model at --shape (the arithmetic task's tokenizer;
   ids it lacks decode to nothing, so every completion runs to --new-tokens and scores 0: the step's cost, not its
   learning, is measured), invariant kernels:
   - `one`: 1 GPU, --prompts prompts x --group completions a step (the per-GPU config);
   - `two`: 2 GPUs colocated (each generates and trains its half of 2 x --prompts), `two-fsdp2` the same with
     FSDP2 trainer ranks;
   - `split-sync` / `split-async`: 2 x --prompts on 2 GPUs with split roles (rank 1 generates, rank 0 trains), at
     policy lag 0 and 1 (rank 1 generates step s + 1 while rank 0 updates on step s);
   - `parity`: 1 GPU, 2 x --prompts, one step: the world-size-1 log-probs every 2-GPU run's step 1 must equal.
   Steps after --warmup count (the first compiles; on a fresh machine the first run's second step still autotunes
   the generator, and a 1-GPU run that goes first would be charged for it): the median sampled tokens per second of
   step time, the median step time, and for split roles the share of each step each rank worked (rank 1:
   generating and scoring its samples with the trainer's forward; rank 0: all but waiting for samples) from the
   run's own metrics. Parity: tokens differing between generator and trainer over every rank's rows of every step
   (0 in invariant mode, or the run stops), and step 1's log-probs of both sides against the `parity` run, bitwise.

Each run writes its folder under --work and is skipped when its metrics are complete, so a command cut off by a
time limit goes on where it stopped (the device allows 10 minutes a command).

    python bench/bench_distributed.py --out runs/bench_distributed.md                      # 2 GPUs, Qwen3-1.7B
    python bench/bench_distributed.py --parts broadcast                                     # the broadcast only
    TRITON_INTERPRET=1 python bench/bench_distributed.py --device cpu --shape tiny --prompts 1 --group 2 \\
        --new-tokens 3 --steps 2 --warmup 1 --work /tmp/bd                                  # a CPU trial (gloo)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit, header

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from workbench.distributed import broadcast, launch
from workbench.models import build, config, save_pretrained
from workbench.rl.config import TrainConfig

RUNS = ("one", "two", "two-fsdp2", "split-sync", "split-async", "parity")
"""Every RL run, in the order they run (name -> world size, prompts, settings: `_run_config`)."""


def _broadcast_worker(shape: str, device: str, reps: int, result: str) -> None:
    d = launch.init(device)
    model = build(shape, device=d.device, dtype=torch.bfloat16, seed=0 if d.rank == 0 else None)
    source = d.rank == 0
    broadcast.broadcast_weights(model, 0 if source else None)   # warm-up: buffers, NCCL's channels
    ours = [broadcast.broadcast_weights(model, 1 + i if source else None) for i in range(reps)]
    flat = torch.empty(ours[0].bytes, dtype=torch.uint8, device=d.device)
    raw = []
    for _ in range(reps + 1):
        dist.barrier()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        t0 = time.perf_counter()
        dist.broadcast(flat, src=0)
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        raw.append(time.perf_counter() - t0)
    if source:
        Path(result).write_text(json.dumps({
            "bytes": ours[0].bytes, "buckets": ours[0].buckets, "ours_s": [r.seconds for r in ours],
            "check_s": [r.check_seconds for r in ours], "raw_s": raw[1:]}))


def bench_broadcast(args) -> list[str]:
    result = Path(args.work) / "broadcast.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    launch.spawn(_broadcast_worker, 2, args.shape, args.device, args.reps, str(result))
    r = json.loads(result.read_text())
    gb = r["bytes"] / 1e9
    ours, check, raw = (statistics.median(r[k]) for k in ("ours_s", "check_s", "raw_s"))
    floor = gb / args.link_gbs
    return ["", f"### Weight broadcast, rank 0 -> rank 1, {args.shape} bf16 ({gb:.2f} GB, {r['buckets']} buckets; "
            f"median of {args.reps})", "",
            "| what | seconds | GB/s | x floor |", "|---|---|---|---|",
            f"| broadcast_weights (buckets, double-buffered) | {ours:.4f} | {gb / ours:.1f} | {ours / floor:.2f} |",
            f"| + digest check | {check:.4f} | | |",
            f"| one raw dist.broadcast of the same bytes (baseline) | {raw:.4f} | {gb / raw:.1f} | {raw / floor:.2f} |",
            f"| floor at {args.link_gbs:.0f} GB/s (nominal link, one way) | {floor:.4f} | {args.link_gbs:.0f} | 1.00 |",
            "", f"Target: <= 0.3 s at the Qwen3-1.7B shape: ours + check = {ours + check:.3f} s."]


def _policy(args) -> Path:
    """A random model at --shape saved with the arithmetic task's tokenizer (once; every run starts from it)."""
    from workbench.rl.policy import train_tokenizer
    from workbench.rl.tasks import Arithmetic

    folder = Path(args.work) / f"policy-{args.shape}"
    if not (folder / "config.json").exists():
        model = build(dataclasses.replace(config(args.shape), max_position_embeddings=4096), dtype=torch.bfloat16,
                      seed=0)
        save_pretrained(model, folder, tokenizer=train_tokenizer(Arithmetic(seed=0)))
    return folder


def _run_config(name: str, args, policy: Path) -> tuple[int, TrainConfig]:
    """(processes, config) of one RL run."""
    world = 1 if name in ("one", "parity") else 2
    prompts = args.prompts if name == "one" else 2 * args.prompts
    cfg = TrainConfig(policy=str(policy), chat_template=False, out_dir=str(Path(args.work) / name), task="arithmetic",
                      steps=1 if name == "parity" else args.steps, prompts_per_step=prompts, group_size=args.group,
                      max_new_tokens=args.new_tokens, lr=1e-6, kernel_mode="invariant",
                      max_tokens_per_microbatch=args.microbatch_tokens, checkpoint_every=10**6, progress=False,
                      device=args.device, variant=name, keep_graphs=args.keep_graphs,
                      activation_checkpointing=args.activation_checkpointing)
    if name == "two-fsdp2":
        cfg = dataclasses.replace(cfg, parallel="fsdp2")
    if name.startswith("split"):
        cfg = dataclasses.replace(cfg, rollout_ranks=1, sync="copy", policy_lag=int(name == "split-async"))
    return world, cfg


def _train(cfg: TrainConfig) -> None:
    from workbench.rl.trainer import train

    train(cfg)


def _complete(cfg: TrainConfig) -> bool:
    path = Path(cfg.out_dir) / "metrics.csv"
    return path.exists() and pd.read_csv(path)["step"].max() >= cfg.steps


def run_rl(names: list[str], args) -> None:
    """Each run not yet complete, from scratch, in processes of its own (a 1-GPU run without torchrun's variables:
    the one-process trainer)."""
    policy = _policy(args)
    for name in names:
        world, cfg = _run_config(name, args, policy)
        if _complete(cfg):
            print(f"{name}: complete in {cfg.out_dir}, kept", flush=True)
            continue
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
        t0 = time.perf_counter()
        if world == 1:
            p = mp.get_context("spawn").Process(target=_train, args=(cfg,))
            p.start()
            p.join()
            if p.exitcode:
                raise RuntimeError(f"run {name} failed (exit code {p.exitcode}); its output is above")
        else:
            launch.spawn(_train, world, cfg)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)


def _metrics(cfg: TrainConfig) -> pd.DataFrame:
    table = pd.read_csv(Path(cfg.out_dir) / "metrics.csv")
    return table.pivot_table(index="step", columns="metric", values="value")


def rl_table(names: list[str], args) -> list[str]:
    policy = _policy(args)
    reference = None
    if "parity" in names:
        ref = np.load(Path(_run_config("parity", args, policy)[1].out_dir) / "step1_logprobs.npz")
        reference = (ref["generator"], ref["trainer"])
    rows, steady = {}, {}
    for name in names:
        world, cfg = _run_config(name, args, policy)
        m = _metrics(cfg)
        later = m[m.index > args.warmup] if len(m) > args.warmup else m
        steady[name] = later
        step_s = later["time_step"].median()
        parts = (later["time_generate"].median(), later["time_train"].median())
        tokens = (later["response_length"] * cfg.prompts_per_step * cfg.group_size / later["time_step"]).median()
        busy = ""
        if cfg.rollout_ranks:
            rollout = ((later["time_generate"] + later["time_score"]) / later["time_step"]).mean()
            trainer = (1 - later["time_trainer_wait"] / later["time_step"]).mean()
            busy = f"{rollout:.0%} / {trainer:.0%}"
        same = ""
        if reference is not None and name != "parity" and cfg.prompts_per_step == 2 * args.prompts:
            got = np.load(Path(cfg.out_dir) / "step1_logprobs.npz")
            same = "yes" if all(np.array_equal(a.view(np.uint32), got[k].view(np.uint32))
                                for a, k in zip(reference, ("generator", "trainer"))) else "**no**"
        rows[name] = (world, cfg, tokens, step_s, parts, int(m["parity_tokens_differing"].sum()), busy, same)
    out = ["", f"### RL steps, {args.shape} (random weights), invariant, {args.group} completions x "
           f"{args.new_tokens} new tokens, medians of steps {args.warmup + 1}..{args.steps} (before: compilation, "
           "autotuning)", "",
           "| run | GPUs | prompts/step | sampled tokens/s | step s | generate s | score + update s | x `one` tokens/s | "
           "tokens differing | busy (rollout / trainer) | step 1 log-probs = 1 GPU's |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows.get("one")
    for name, (world, cfg, tokens, step_s, (gen_s, train_s), differing, busy, same) in rows.items():
        if name == "parity":   # one step, compilation included: its speed means nothing
            out.append(f"| {name} | {world} | {cfg.prompts_per_step} | | | | | | {differing} | | (reference) |")
            continue
        ratio = f"{tokens / base[2]:.2f}" if base else ""
        out.append(f"| {name} | {world} | {cfg.prompts_per_step} | {tokens:,.0f} | {step_s:.2f} | {gen_s:.2f} | "
                   f"{train_s:.2f} | {ratio} | {differing} | {busy} | {same} |")
    out.append("")
    if "split-async" in rows:
        for sync, target in (("split-sync", " (target <= 0.6)"), ("two", ", colocated synchronous, for reference")):
            if sync in rows:
                out.append(f"- split-async step / {sync} step (same batch, same 2 GPUs): "
                           f"{rows['split-async'][3] / rows[sync][3]:.2f}{target}")
        over = steady["split-async"]
        work = over["time_generate"].sum() + over["time_score"].sum()
        out.append(f"- split-async: the rollout rank's generating and scoring overlapped with the previous update "
                   f"{over['time_overlap'].sum() / work:.0%} of its time; weights sent "
                   f"{over['time_sync'].median():.3f} s a step (median)")
    if base and "two" in rows:
        out.append(f"- two / one sampled tokens/s (same config per GPU): {rows['two'][2] / base[2]:.2f} "
                   "(target >= 1.8)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["broadcast", "rl"], choices=["broadcast", "rl"])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS, help="RL runs to do (default: all)")
    ap.add_argument("--shape", default="qwen3-1.7B")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=32, help="prompts a step per GPU (the `one` run's)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--keep-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the generator's KV caches and decode graphs between steps (TrainConfig.keep_graphs)")
    ap.add_argument("--activation-checkpointing", default="none", choices=["none", "mlp", "layers"],
                    help="what the update's backward recomputes (TrainConfig.activation_checkpointing)")
    ap.add_argument("--reps", type=int, default=5, help="broadcasts timed")
    ap.add_argument("--link-gbs", type=float, default=450.0,
                    help="the GPUs' link bandwidth one way, GB/s (H100/H200 NVLink 4: 450)")
    ap.add_argument("--work", default="runs/bench_distributed", help="the runs' folders (kept: a rerun resumes)")
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    args = ap.parse_args()
    one_gpu = "broadcast" not in args.parts and set(args.runs) <= {"one", "parity"}
    if args.device == "cuda" and torch.cuda.device_count() < (1 if one_gpu else 2):
        raise SystemExit(f"this benchmark needs 2 GPUs, {torch.cuda.device_count()} visible; "
                         "--device cpu runs it on gloo")
    lines = [header()]
    if "broadcast" in args.parts:
        lines += bench_broadcast(args)
    if "rl" in args.parts:
        run_rl(args.runs, args)
        lines += rl_table(args.runs, args)
    emit(lines, args.out)


if __name__ == "__main__":
    main()

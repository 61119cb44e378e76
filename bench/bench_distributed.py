"""Issues 17 and 44 on one host with N GPUs: the weight broadcast, and RL steps on one GPU against N, colocated and
with split roles in each rollout:trainer ratio worth measuring, synchronous and asynchronous, each figure beside its
baseline measured in the same run.

1. **Broadcast** (N processes): the trainer's bf16 weights at --shape from rank 0 to ranks 1..N-1 with
   `broadcast.broadcast_weights` (buckets, double-buffered, then the digest check), as split roles with one trainer
   rank send them, beside one raw NCCL `dist.broadcast` of the same bytes as one flat buffer (the link's own speed:
   the baseline), and the floor at the link's nominal bandwidth (--link-gbs: NCCL pipelines a broadcast through the
   ranks, so every receiver's link carries the bytes once whatever N).
2. **RL steps** through `workbench.rl.trainer.train` on a random model at --shape (the arithmetic task's tokenizer;
   ids it lacks decode to nothing, so every completion runs to --new-tokens and scores 0: the step's cost, not its
   learning, is measured), invariant kernels (`plan` lists them):
   - `one`: 1 GPU, --prompts prompts x --group completions a step (the per-GPU config);
   - `dp`: N GPUs colocated (each generates and trains its 1/N of N x --prompts), `dp-fsdp2` the same with FSDP2
     trainer ranks;
   - `split-<r>r<t>t-sync` / `-async`: r rollout ranks and t = N - r trainer ranks, at policy lag 0 and 1 (the
     rollout ranks generate step s + 1 while the trainer ranks update on step s), with N x --prompts rounded down to
     a multiple of both r and t (each side's ranks take equal whole shares), for each r of --rollout-ranks;
   - with --parity-sample n > 1, each run that scores its samples in a pass of its own (the split runs and
     `dp-fsdp2`; the others score in the update's forward) again as `<run>-check<n>`, recomputing 1 completion in n
     (TrainConfig.parity_sample);
   - `parity-<P>`: 1 GPU, P prompts, one step, for each P an N-GPU run takes: the world-size-1 log-probs that run's
     step 1 must equal, bitwise. Its generator's cache is freed before the update (keep_graphs off: one step, its
     speed means nothing), so N x the per-GPU batch fits on one GPU.
   Steps after --warmup count (the first compiles; on a fresh machine the first run's second step still autotunes
   the generator, and a 1-GPU run that goes first would be charged for it): the median sampled tokens per second of
   step time, the median step time and its halves, and for split roles the share of each step each side worked
   (rollout: the slowest rollout rank generating and scoring its samples with the trainer's forward; trainer: all
   but waiting for samples) from the run's own metrics. Parity: tokens differing between generator and trainer over
   every rank's rows of every step (0 in invariant mode, or the run stops), and step 1's log-probs of both sides
   against the `parity-<P>` run of the same P.

Each run writes its folder under --work and is skipped when its metrics are complete, so a command cut off by a
time limit goes on where it stopped (the device allows 10 minutes a command). A finished run keeps only its
metrics.csv, step1_logprobs.npz and config.yaml (its final checkpoint, ~20 GB at the 1.7B shape, is deleted): a
--work folder copied to a fresh machine resumes there too.

    python bench/bench_distributed.py --out runs/bench_distributed.md             # every GPU visible, Qwen3-1.7B
    python bench/bench_distributed.py --gpus 4 --plan                              # the runs' names, nothing run
    python bench/bench_distributed.py --gpus 4 --parts rl --runs one dp parity-128 # some runs only
    python bench/bench_distributed.py --parts broadcast                            # the broadcast only
    TRITON_INTERPRET=1 python bench/bench_distributed.py --device cpu --gpus 3 --shape tiny --prompts 2 --group 2 \\
        --new-tokens 3 --steps 2 --warmup 1 --work /tmp/bd                         # a CPU trial (gloo, 3 processes)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from timing import emit, header

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from workbench.distributed import broadcast, launch
from workbench.models import build, config, save_pretrained
from workbench.rl.config import TrainConfig

KEPT = ("metrics.csv", "step1_logprobs.npz", "config.yaml")
"""What a finished run keeps of its folder: the table's inputs (and the config, to read what ran)."""


@dataclass(frozen=True)
class Run:
    """One RL run of the benchmark."""

    name: str
    """Its row in the table and its folder under --work."""
    gpus: int
    """Processes, one a GPU (1: the one-process trainer, without torchrun's variables)."""
    prompts: int
    """Prompts a step, over all its GPUs."""
    rollout_ranks: int = 0
    """Ranks that only generate (TrainConfig.distributed.rollout_ranks; 0: colocated)."""
    policy_lag: int = 0
    """TrainConfig.rollout.policy_lag: 1 lets the rollout ranks generate step s + 1 during step s's update."""
    parallel: str = "replicate"
    """TrainConfig.distributed.parallel of the trainer ranks."""
    parity: bool = False
    """The one-step, one-GPU reference of an N-GPU run's step-1 log-probs at the same prompts a step."""
    parity_sample: int = 1
    """TrainConfig.parity_sample: the parity check recomputes 1 completion in this many."""


def rollout_counts(gpus: int) -> list[int]:
    """The rollout ranks of the split runs at N GPUs: every split up to 4 GPUs; beyond, a quarter, a half and three
    quarters of them (each split is two runs of minutes; at the 1.7B shape a step's two halves, generate + score
    and update, are of one size (docs/results/2026-11-26_distributed-rollout-scores-2xH200_769c19b), which puts the
    best ratio near the middle)."""
    if gpus <= 4:
        return list(range(1, gpus))
    return sorted({max(1, gpus // 4), gpus // 2, gpus - max(1, gpus // 4)})


def split_prompts(total: int, rollout: int, trainer: int) -> int:
    """The most prompts a step, up to `total`, that both sides share evenly (`Pipeline.shard`: whole, equal shares
    on each side): a multiple of both rank counts (0 when `total` is below it)."""
    unit = math.lcm(rollout, trainer)
    return total // unit * unit


def plan(gpus: int, prompts: int, rollouts: list[int], parity_sample: int = 1) -> list[Run]:
    """Every RL run at `gpus` GPUs and `prompts` prompts per GPU, in the order they run: one, the colocated runs,
    the split runs (rollout ranks in `rollouts`), with `parity_sample` > 1 those that score in a pass of their own
    again, checking 1 completion in `parity_sample`, then one parity run per prompts a step the N-GPU runs take."""
    total = gpus * prompts
    runs = [Run("one", 1, prompts), Run("dp", gpus, total), Run("dp-fsdp2", gpus, total, parallel="fsdp2")]
    for r in rollouts:
        if not 0 < r < gpus:
            raise SystemExit(f"--rollout-ranks {r}: a split of {gpus} GPUs needs 1 to {gpus - 1} rollout ranks")
        n = split_prompts(total, r, gpus - r)
        if not n:
            raise SystemExit(f"{prompts} prompts per GPU x {gpus} GPUs cannot be shared by {r} rollout and "
                             f"{gpus - r} trainer ranks: pass --prompts {-(-math.lcm(r, gpus - r) // gpus)} or more, "
                             f"or leave {r} out of --rollout-ranks")
        runs += [Run(f"split-{r}r{gpus - r}t-{kind}", gpus, n, rollout_ranks=r, policy_lag=lag)
                 for kind, lag in (("sync", 0), ("async", 1))]
    if parity_sample > 1:
        runs += [dataclasses.replace(run, name=f"{run.name}-check{parity_sample}", parity_sample=parity_sample)
                 for run in runs if run.rollout_ranks or run.parallel == "fsdp2"]
    batches = sorted({run.prompts for run in runs if run.gpus > 1}, reverse=True)
    return runs + [parity_run(n) for n in batches]


def parity_run(prompts: int) -> Run:
    """The one-GPU, one-step reference of the N-GPU runs of `prompts` prompts a step."""
    return Run(f"parity-{prompts}", 1, prompts, parity=True)


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
    result = Path(args.work) / f"broadcast-{args.gpus}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    launch.spawn(_broadcast_worker, args.gpus, args.shape, args.device, args.reps, str(result))
    r = json.loads(result.read_text())
    gb = r["bytes"] / 1e9
    ours, check, raw = (statistics.median(r[k]) for k in ("ours_s", "check_s", "raw_s"))
    floor = gb / args.link_gbs
    to = "rank 1" if args.gpus == 2 else f"ranks 1..{args.gpus - 1}"
    return ["", f"### Weight broadcast, rank 0 -> {to}, {args.shape} bf16 ({gb:.2f} GB, {r['buckets']} buckets; "
            f"median of {args.reps})", "",
            "| what | seconds | GB/s | x floor |", "|---|---|---|---|",
            f"| broadcast_weights (buckets, double-buffered) | {ours:.4f} | {gb / ours:.1f} | {ours / floor:.2f} |",
            f"| + digest check | {check:.4f} | | |",
            f"| one raw dist.broadcast of the same bytes (baseline) | {raw:.4f} | {gb / raw:.1f} | {raw / floor:.2f} |",
            f"| floor at {args.link_gbs:.0f} GB/s (nominal link, one way) | {floor:.4f} | {args.link_gbs:.0f} | 1.00 |",
            "", f"Target: <= 0.3 s at the Qwen3-1.7B shape: ours + check = {ours + check:.3f} s."]


def _policy(args) -> Path:
    """A random model at --shape saved with the arithmetic task's tokenizer (once; every run starts from it)."""
    from workbench.policies.selftrained import train_tokenizer
    from workbench.tasks import Arithmetic

    folder = Path(args.work) / f"policy-{args.shape}"
    if not (folder / "config.json").exists():
        model = build(dataclasses.replace(config(args.shape), max_position_embeddings=4096), dtype=torch.bfloat16,
                      seed=0)
        save_pretrained(model, folder, tokenizer=train_tokenizer(Arithmetic(seed=0)))
    return folder


def _folder(run: Run, args) -> Path:
    """A run's folder: the 1-GPU runs' are the same at any N (shared), the N-GPU runs' under `<N>gpu/`."""
    return Path(args.work) / (run.name if run.gpus == 1 else f"{run.gpus}gpu/{run.name}")


def _run_config(run: Run, args, policy: Path) -> TrainConfig:
    cfg = TrainConfig(policy=str(policy), chat_template=False, out_dir=str(_folder(run, args)), task="arithmetic",
                      steps=1 if run.parity else args.steps, prompts_per_step=run.prompts, group_size=args.group,
                      max_new_tokens=args.new_tokens, lr=1e-6, kernel_mode="invariant",
                      max_tokens_per_microbatch=args.microbatch_tokens, checkpoint_every=10**6, progress=False,
                      device=args.device, variant=run.name, keep_graphs=args.keep_graphs and not run.parity,
                      activation_checkpointing=args.activation_checkpointing, parallel=run.parallel,
                      policy_lag=run.policy_lag, rollout_ranks=run.rollout_ranks,
                      sync="copy" if run.rollout_ranks else "shared", parity_sample=run.parity_sample)
    return cfg


def _train(cfg: TrainConfig) -> None:
    from workbench.rl.trainer import train

    train(cfg)


def _complete(cfg: TrainConfig) -> bool:
    """The run finished every step with these settings (a folder of other settings, e.g. another --new-tokens under
    the same --work, is not this run)."""
    from workbench.config import read_config_file

    folder = Path(cfg.out_dir)
    if not (folder / "metrics.csv").exists() or not (folder / "config.yaml").exists():
        return False
    try:
        same = TrainConfig(**read_config_file(folder / "config.yaml", TrainConfig)) == cfg
    except (ValueError, TypeError):   # settings this TrainConfig no longer reads: an older tree's run
        same = False
    if not same:
        print(f"{cfg.variant}: {folder} holds a run of other settings; running it again", flush=True)
        return False
    return pd.read_csv(folder / "metrics.csv")["step"].max() >= cfg.steps


def run_rl(runs: list[Run], args) -> None:
    """Each run not yet complete, from scratch, in processes of its own (a 1-GPU run without torchrun's variables:
    the one-process trainer); a finished run's folder keeps only `KEPT`."""
    policy = _policy(args)
    for run in runs:
        cfg = _run_config(run, args, policy)
        if _complete(cfg):
            print(f"{run.name}: complete in {cfg.out_dir}, kept", flush=True)
            continue
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
        t0 = time.perf_counter()
        if run.gpus == 1:
            p = mp.get_context("spawn").Process(target=_train, args=(cfg,))
            p.start()
            p.join()
            if p.exitcode:
                raise RuntimeError(f"run {run.name} failed (exit code {p.exitcode}); its output is above")
        else:
            launch.spawn(_train, run.gpus, cfg)
        for path in Path(cfg.out_dir).iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.name not in KEPT:
                path.unlink()
        print(f"{run.name}: {time.perf_counter() - t0:.0f} s", flush=True)


def _metrics(cfg: TrainConfig) -> pd.DataFrame:
    table = pd.read_csv(Path(cfg.out_dir) / "metrics.csv")
    return table.pivot_table(index="step", columns="metric", values="value")


def _same_step1(cfg: TrainConfig, reference: Path) -> str:
    """'yes' when the run's step-1 log-probs (generator and trainer) are the reference run's bits, '' without one."""
    if not (reference / "step1_logprobs.npz").exists():
        return ""
    ref, got = (np.load(Path(folder) / "step1_logprobs.npz") for folder in (reference, cfg.out_dir))
    return "yes" if all(np.array_equal(ref[k].view(np.uint32), got[k].view(np.uint32))
                        for k in ("generator", "trainer")) else "**no**"


def rl_table(runs: list[Run], args) -> list[str]:
    policy = _policy(args)
    rows, steady = {}, {}
    for run in runs:
        cfg = _run_config(run, args, policy)
        m = _metrics(cfg)
        later = m[m.index > args.warmup] if len(m) > args.warmup else m
        steady[run.name] = later
        step_s = later["time_step"].median()
        parts = (later["time_generate"].median(), later["time_train"].median())
        sequences = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        tokens = (later["response_length"] * sequences / later["time_step"]).median()
        busy = ""
        if run.rollout_ranks:
            rollout = ((later["time_generate"] + later["time_score"]) / later["time_step"]).mean()
            trainer = (1 - later["time_trainer_wait"] / later["time_step"]).mean()
            busy = f"{rollout:.0%} / {trainer:.0%}"
        same = ""
        if run.gpus > 1:
            same = _same_step1(cfg, _folder(parity_run(run.prompts), args))
        differing = f"{m['parity_tokens_differing'].sum():.0f}"
        if run.parity_sample > 1:   # step 1 checks every completion; the share of the later steps' tokens checked
            after = m[m.index > 1]
            every = (after["response_length"] * cfg.rollout.prompts_per_step * cfg.rollout.group_size).sum()
            differing += f" (checked: step 1 all, then {after['parity_tokens_checked'].sum() / every:.1%})"
        rows[run.name] = (run, tokens, step_s, parts, differing, busy, same)
    out = ["", f"### RL steps, {args.shape} (random weights), invariant, {args.group} completions x "
           f"{args.new_tokens} new tokens, {args.prompts} prompts per GPU, medians of steps "
           f"{args.warmup + 1}..{args.steps} (before: compilation, autotuning)", "",
           "| run | GPUs | prompts/step | sampled tokens/s | step s | generate s | score + update s | "
           "x `one` tokens/s | tokens differing | busy (rollout / trainer) | step 1 log-probs = 1 GPU's |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows.get("one")
    for name, (run, tokens, step_s, (gen_s, train_s), differing, busy, same) in rows.items():
        if run.parity:   # one step, compilation included: its speed means nothing
            out.append(f"| {name} | 1 | {run.prompts} | | | | | | {differing} | | (reference) |")
            continue
        ratio = f"{tokens / base[1]:.2f}" if base else ""
        out.append(f"| {name} | {run.gpus} | {run.prompts} | {tokens:,.0f} | {step_s:.2f} | {gen_s:.2f} | "
                   f"{train_s:.2f} | {ratio} | {differing} | {busy} | {same} |")
    return out + [""] + _summary(rows, steady, args)


def _summary(rows: dict, steady: dict, args) -> list[str]:
    """The targets' lines: N-GPU speed against `one` (>= 0.95 N), each split's asynchronous step against its
    synchronous one (<= 0.6) and against the colocated step, and where the split's weights went."""
    out, goal = [], 0.95 * args.gpus
    base = rows.get("one")
    if base and "dp" in rows:
        out.append(f"- dp / one sampled tokens/s (same config per GPU, {args.gpus} GPUs): "
                   f"{rows['dp'][1] / base[1]:.2f} (target >= 0.95 x {args.gpus} = {goal:.2f})")
    splits = [name for name, row in rows.items() if row[0].rollout_ranks]
    if base and splits:
        best = max(splits, key=lambda name: rows[name][1])
        out.append(f"- best split roles: {best} / one sampled tokens/s: {rows[best][1] / base[1]:.2f} "
                   f"(target >= {goal:.2f})")
    for name in splits:
        if "-async" not in name:
            continue
        for other, target in ((name.replace("-async", "-sync"), " (target <= 0.6)"),
                              ("dp", ", colocated synchronous, for reference")):
            if other in rows:
                a, b = rows[name][0].prompts, rows[other][0].prompts
                batch = "" if a == b else f", {a} vs {b} prompts a step"
                out.append(f"- {name} step / {other} step (same GPUs{batch}): "
                           f"{rows[name][2] / rows[other][2]:.2f}{target}")
        over = steady[name]
        work = over["time_generate"].sum() + over["time_score"].sum()
        out.append(f"- {name}: the rollout ranks' generating and scoring overlapped with the previous update "
                   f"{over['time_overlap'].sum() / work:.0%} of their time; weights sent "
                   f"{over['time_sync'].median():.3f} s a step (median)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["broadcast", "rl"], choices=["broadcast", "rl"])
    ap.add_argument("--gpus", type=int, help="GPUs of the N-GPU runs and the broadcast (default: every GPU visible, "
                                             "at least 2; with --device cpu, 2 gloo processes)")
    ap.add_argument("--rollout-ranks", type=int, nargs="+",
                    help="the split runs' rollout ranks (default: `rollout_counts`, every split up to 4 GPUs)")
    ap.add_argument("--runs", nargs="+", help="RL runs to do, by name (default: all; --plan lists them)")
    ap.add_argument("--plan", action="store_true", help="print the runs of this command line and stop")
    ap.add_argument("--shape", default="qwen3-1.7B")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=32, help="prompts a step per GPU (the `one` run's)")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--keep-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the generator's KV caches and decode graphs between steps "
                         "(TrainConfig.rollout.keep_graphs)")
    ap.add_argument("--activation-checkpointing", default="none", choices=["none", "mlp", "layers"],
                    help="what the update's backward recomputes (TrainConfig.optim.activation_checkpointing)")
    ap.add_argument("--parity-sample", type=int, default=1,
                    help="n > 1: the runs that score in a pass of their own also as `<run>-check<n>`, recomputing 1 "
                         "completion in n for the parity check (TrainConfig.parity_sample)")
    ap.add_argument("--reps", type=int, default=5, help="broadcasts timed")
    ap.add_argument("--link-gbs", type=float, default=450.0,
                    help="the GPUs' link bandwidth one way, GB/s (H100/H200 NVLink 4: 450)")
    ap.add_argument("--work", default="runs/bench_distributed", help="the runs' folders (kept: a rerun resumes)")
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    args = ap.parse_args()
    visible = torch.cuda.device_count() if args.device == "cuda" else None
    # At least 2, so that a host of one GPU still plans (and runs) the one-GPU runs: `--runs one` there.
    args.gpus = args.gpus or max(2, visible or 0)
    if args.gpus < 2:
        raise SystemExit(f"--gpus {args.gpus}: the benchmark compares N >= 2 GPUs with one; pass --gpus 2 or more "
                         f"(--device cpu runs it on gloo)")
    every = plan(args.gpus, args.prompts, args.rollout_ranks or rollout_counts(args.gpus), args.parity_sample)
    by_name = {run.name: run for run in every}
    unknown = sorted(set(args.runs or ()) - set(by_name))
    if unknown:
        raise SystemExit(f"--runs {' '.join(unknown)}: no such run at {args.gpus} GPUs; the runs are "
                         f"{' '.join(by_name)}")
    runs = [by_name[name] for name in args.runs] if args.runs else every
    if args.plan:
        for run in runs:
            print(f"{run.name}: {run.gpus} GPU(s), {run.prompts} prompts a step, rollout ranks {run.rollout_ranks}, "
                  f"policy lag {run.policy_lag}, {run.parallel}")
        return
    needed = max([run.gpus for run in runs if "rl" in args.parts] + [args.gpus if "broadcast" in args.parts else 1])
    if visible is not None and visible < needed:
        fewer = f"pass --gpus {visible}, " if visible >= 2 else "run only `one` and the parity runs (--parts rl), "
        raise SystemExit(f"these runs need {needed} GPUs, {visible} visible: {fewer}or --device cpu to run them on "
                         "gloo")
    lines = [header()]
    if "broadcast" in args.parts:
        lines += bench_broadcast(args)
    if "rl" in args.parts:
        run_rl(runs, args)
        lines += rl_table(runs, args)
    emit(lines, args.out)


if __name__ == "__main__":
    main()

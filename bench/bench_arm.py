"""Does one arm of a regime cell fit one GPU window? (issue 59, item 2)

An arm is one arm of a cell (`on`, `off`, ...) over its seeds, 300 steps each (the pre-registered plan:
docs/results/2026-12-02_regime-plan). The runner runs the seeds as worker processes side by side under its own
MPS daemon (onoff/mps.py). This runs, on preset `regime` at --max-new-tokens with a few steps each:

- one seed alone (one worker, no MPS): its median step, the same-run baseline; the seeds one after another would
  take seeds x steps x this;
- every seed at once (one worker each, MPS on): each run's median step, and the packing factor
  (seeds x alone step / packed step: the aggregate throughput over one run's);
- the arm projected to --arm-steps steps: the packed median step times the steps, plus the measured start of the
  packed call (its wall time not spent in measured steps: model loads, compiles, graph captures), against the
  window (default 25 minutes, issue 59).

Medians leave out the first --warmup steps. The base policy samples shorter completions than a warm start
(`--policy` takes a warm-started folder), which makes the projection optimistic for the update's share.

    python bench/bench_arm.py [--arm on] [--max-new-tokens 1024] [--steps 8] [--policy DIR] [--out FILE.md]
                              [--set max_tokens_per_microbatch=32768 ...]
    python bench/bench_arm.py --smoke --seeds 2 --steps 3 --warmup 1 --max-new-tokens 4   # CPU: the script runs
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from workbench.config import parse_overrides
from workbench.onoff.config import OnOffConfig, preset
from workbench.onoff.runner import run_on_off

from step_breakdown import PARTS, breakdown
from timing import emit, header


def _runs(out: Path, arm: str, seeds: tuple[int, ...], warmup: int) -> list[dict]:
    """Each run's medians over its steps after `warmup`: the step and its phases (step_breakdown.py)."""
    return [breakdown(pd.read_csv(out / f"{arm}-seed{seed}" / "metrics.csv"), warmup) for seed in seeds]


def measure(arm: str, length: int, steps: int, seeds: tuple[int, ...], warmup: int, policy: str, out: Path,
            overrides: dict, smoke: bool = False) -> dict:
    """The alone and packed medians of `arm` at `length` new tokens, and the packed call's wall seconds."""
    common = dict(arms=(arm,), steps=steps, max_new_tokens=length, progress=False, checkpoint_every=steps,
                  **({"policy": policy} if policy else {}), **overrides)
    alone = out / "alone"
    run_on_off(preset("regime", smoke, seeds=seeds[:1], workers=1, mps="off", out_dir=str(alone), **common))
    packed = out / "packed"
    t = time.perf_counter()
    run_on_off(preset("regime", smoke, seeds=seeds, workers=len(seeds), mps="on", out_dir=str(packed), **common))
    wall = time.perf_counter() - t
    return {"alone": _runs(alone, arm, seeds[:1], warmup)[0], "packed": _runs(packed, arm, seeds, warmup),
            "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", default="on")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="steps per run measured")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out (compiles, graph captures)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--arm-steps", type=int, default=300, help="the plan's steps per run")
    ap.add_argument("--window-min", type=float, default=25.0, help="the GPU window an arm must fit (minutes)")
    ap.add_argument("--policy", default="", help="the starting policy (e.g. a warm-started folder)")
    ap.add_argument("--out-dir", default="runs/bench-arm")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="the preset's settings changed")
    ap.add_argument("--smoke", action="store_true", help="a CPU check of the script: its numbers are no result")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        raise SystemExit(f"bench_arm: --steps {a.steps} must exceed --warmup {a.warmup} (medians need steps)")
    seeds = tuple(range(a.seeds))
    r = measure(a.arm, a.max_new_tokens, a.steps, seeds, a.warmup, a.policy, Path(a.out_dir),
                parse_overrides(a.set, OnOffConfig), a.smoke)
    steps = sorted(x["step"] for x in r["packed"])
    packed, alone = steps[len(seeds) // 2], r["alone"]["step"]
    start_s = max(r["wall"] - a.steps * steps[-1], 0.0)
    arm_min = (a.arm_steps * packed + start_s) / 60
    serial_min = len(seeds) * a.arm_steps * alone / 60
    phases = {p: sorted(x[p] for x in r["packed"])[len(seeds) // 2] for p in PARTS}
    lines = [header(), "",
             f"Preset `regime`, arm `{a.arm}`, {a.max_new_tokens} max new tokens, {a.policy or 'the base policy'}"
             f"{''.join(' ' + x for x in a.set)}; {a.steps} steps a run, medians after step {a.warmup}.", "",
             "| figure | value |", "|---|---|",
             f"| step alone (1 run, no MPS) | {alone:.2f} s |",
             f"| step packed ({len(seeds)} runs under MPS), median of runs | {packed:.2f} s "
             f"(runs {steps[0]:.2f}-{steps[-1]:.2f}) |",
             f"| packing factor (aggregate / one run's) | {len(seeds) * alone / packed:.2f}x |",
             *(f"| {p}: alone / packed (medians) | {r['alone'][p]:.2f} s / {phases[p]:.2f} s |" for p in PARTS),
             f"| mean completion tokens: alone / packed | {r['alone']['length']:.0f} / "
             f"{sorted(x['length'] for x in r['packed'])[len(seeds) // 2]:.0f} |",
             f"| packed call's start (wall not in steps) | {start_s:.0f} s |",
             f"| arm projected ({len(seeds)} seeds x {a.arm_steps} steps, packed) | {arm_min:.1f} min |",
             f"| baseline: the seeds one after another, alone | {serial_min:.1f} min |",
             f"| fits a {a.window_min:g}-minute window | {'yes' if arm_min <= a.window_min else 'no'} |"]
    emit(lines, a.out)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:   # a bad --set, or a setting the preset refuses: one line, as profile_regime.py
        raise SystemExit(f"bench_arm: {e}") from None

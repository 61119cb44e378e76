"""The ON/OFF GRPO experiment on a GPU: invariant vs standard step time, parity, reward gain.

Trains the small starting policy (once, into --out-dir/policy), then 100 GRPO steps per
(mode, seed) on the arithmetic task; prints the summary table with the invariant / standard
step-time ratio. The long metrics table is --out-dir/metrics.csv (notebook 05 plots it).

    python bench/bench_rl.py --out runs/bench_rl.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit, header

from workbench.rl.experiment import FULL, OnOffConfig, run_on_off, summarize_on_off

SHAPE = {k: v for k, v in FULL.items() if k not in ("steps", "seeds")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", help="write the table here too")
    p.add_argument("--out-dir", default="runs/onoff-gpu")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args()
    cfg = OnOffConfig(out_dir=a.out_dir, steps=a.steps, seeds=tuple(a.seeds), device="cuda", progress=False,
                      **SHAPE)
    summary = summarize_on_off(run_on_off(cfg))
    shape = ", ".join(f"{k}={v}" for k, v in SHAPE.items())
    cols = ["variant", "runs", "steps", "reward_first", "reward_last", "reward_gain", "steps_with_differing_tokens",
            "tokens_differing_total", "parity_max_abs_diff", "step_s_median", "generate_s_median", "train_s_median",
            "step_time_vs_standard"]
    lines = [header(), "", f"ON/OFF GRPO, {cfg.steps} steps x seeds {list(cfg.seeds)}; {shape}.",
             "Rewards: mean over the first / last 10 steps of all seeds. Times: medians over steps 2..N.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in summary.itertuples(index=False):
        lines.append("| " + " | ".join(f"{getattr(r, c):.4g}" if isinstance(getattr(r, c), float)
                                       else str(getattr(r, c)) for c in cols) + " |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()

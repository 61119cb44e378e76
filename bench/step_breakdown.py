"""One GPU's RL step taken apart (issue 44, target 4), from the metrics of finished `train` runs: per run folder, the
medians over the steps after --warmup (the first compile and autotune) of
- the step, and its parts: generate; score (the trainer's forward over the samples: the parity check, which is the
  old policy's log-probs too; 0 where the update's own forward scored the step, `scoring.scores_in_update`, its time
  then in update); update (the rest of `train`'s half: rewards, advantages, the forward and backward passes and the
  optimizer step); sync (the generator gets the new weights); other (the step not in those);
- sampled tokens per second of step time, and the tokens differing between generator and trainer over every step.

    python bench/step_breakdown.py runs/one runs/smollm2-gsm8k [--warmup 1] [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from timing import emit

PARTS = ("generate", "score", "update", "sync", "other")


def breakdown(metrics: pd.DataFrame, warmup: int) -> dict[str, float]:
    """The medians of one run's long metrics table (step, metric, value) over steps > warmup."""
    m = metrics.pivot_table(index="step", columns="metric", values="value")
    if "time_score" not in m:
        raise SystemExit("the run logged no time_score: a colocated run of a tree from 2026-11-28 on is needed")
    if "time_trainer_wait" in m:   # its rollout ranks scored beside generating: score is not inside train there
        raise SystemExit("a split-roles run: its step has no such parts; bench/bench_distributed.py tables it")
    later = m[m.index > warmup] if len(m) > warmup else m
    parts = pd.DataFrame({"generate": later["time_generate"], "score": later["time_score"],
                          "update": later["time_train"] - later["time_score"], "sync": later["time_sync"]})
    parts["other"] = later["time_step"] - parts.sum(axis=1)
    return {"steps": f"{int(later.index.min())}-{int(later.index.max())}", "step": later["time_step"].median(),
            **parts.median().to_dict(), "tokens/s": later["tokens_per_s"].median(),
            "length": later["response_length"].median(), "differing": int(m["parity_tokens_differing"].sum())}


def table(folders: list[Path], warmup: int) -> list[str]:
    lines = ["| run | steps | step s | " + " | ".join(f"{p} s" for p in PARTS)
             + " | mean completion tokens | sampled tokens/s of step time | tokens differing |",
             "|---|---|---|" + "---|" * len(PARTS) + "---|---|---|"]
    for folder in folders:
        path = folder / "metrics.csv"
        if not path.exists():
            raise SystemExit(f"{path}: no metrics; give the out_dir of a finished `train` run")
        r = breakdown(pd.read_csv(path), warmup)
        lines.append(f"| {folder.name} | {r['steps']} | {r['step']:.2f} | "
                     + " | ".join(f"{r[p]:.2f}" for p in PARTS)
                     + f" | {r['length']:.0f} | {r['tokens/s']:,.0f} | {r['differing']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with its metrics.csv)")
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    emit(table(a.runs, a.warmup), a.out)


if __name__ == "__main__":
    main()

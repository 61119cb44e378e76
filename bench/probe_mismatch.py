"""The OFF arms' mismatch before training, per preset, beside the engine they model.

Runs each arm of a preset for `--steps` steps (seed 0 by default; `workbench.onoff.probe`) and prints, per arm,
KL(sampler || trainer) per token, the mean and max |Δ log-prob|, the spread of the sequence log-ratio and the share
of sequences a 0.2 clip would cut. The baseline is `off-vllm` (vLLM's own model and default kernels, the blog's OFF)
on the same preset and policy: measured in this run when the arms include it, else its first steps as published
under docs/results (its source folder is printed). The target for the embedded `off`: KL and mean |Δ| within a
factor 2 of `off-vllm`'s.

    python bench/probe_mismatch.py --preset blog --arms off off-shapes [--lengths 256 2048] [--out FILE.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from workbench.onoff.config import preset
from workbench.onoff.probe import PROBE_METRICS, probe, published_metrics

COLUMNS = {"sampler_trainer_kl": "KL / token", "parity_mean_abs_diff": "mean |Δ|", "parity_max_abs_diff": "max |Δ|",
           "seq_logratio_sd": "sd seq log-ratio", "seq_ratio_outside_1.2": "seqs outside 1.2",
           "reward_mean": "start reward", "response_length": "length", "time_step": "s / step"}


def _baseline(root: Path, preset_name: str, steps: int, seeds) -> pd.DataFrame:
    table = published_metrics(root, preset_name, "off-vllm")
    table = table[(table.step <= steps) & table.seed.isin(seeds) & table.metric.isin(PROBE_METRICS)]
    if table.empty:
        return pd.DataFrame()
    row = table.groupby("metric").value.mean().to_dict()
    return pd.DataFrame([{"arm": f"off-vllm (published: {table.source.iloc[0]})", **row}])


def _markdown(table: pd.DataFrame) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--arms", nargs="+", default=["off", "off-shapes"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lengths", nargs="*", type=int, default=[])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out-dir", default="runs/probe")
    p.add_argument("--published", default="docs/results", help="where the off-vllm baseline is read from")
    p.add_argument("--out", default="", help="also write the table here (markdown)")
    args = p.parse_args()
    cfg = preset(args.preset, arms=tuple(args.arms), seeds=tuple(args.seeds), workers=args.workers,
                 out_dir=f"{args.out_dir}/{args.preset}", progress=False)
    rows = probe(cfg, steps=args.steps, lengths=tuple(args.lengths))
    table = rows.groupby(["max_new_tokens", "arm"], as_index=False)[list(COLUMNS)].mean()
    if "off-vllm" not in args.arms:
        base = _baseline(Path(args.published), args.preset, args.steps, args.seeds)
        if not base.empty:
            table = pd.concat([table, base.assign(max_new_tokens=cfg.run.rollout.max_new_tokens)], ignore_index=True)
    text = (f"Preset `{args.preset}`, seeds {args.seeds}, means over steps 1-{args.steps}\n\n"
            + _markdown(table.rename(columns=COLUMNS)))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:   # a bad preset, arm or setting: the one line that says which
        raise SystemExit(f"probe_mismatch: {e}") from None

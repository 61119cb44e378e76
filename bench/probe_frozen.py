"""The frozen-policy probe (issue 59, item 4): with lr = 0 the policy never moves, so whatever an arm's ratios spend
of the trust region is numerics alone (RLinf#1534 measured 4.6% of tokens clipped that way).

Runs the arms (default on, off, off-fp8) of a preset (default `regime`) at each length (max_new_tokens) for K steps
with lr = 0, for each loss (default grpo, the token level, and blog, the summed sequence ratio; gspo optional), and
writes per arm x length x loss, the means over the steps and seeds:
- token clip share: tokens whose own ratio exp(logp - old) lies outside [0.8, 1.2] (`losses._outside_band`);
- sequence clip share: sequences whose summed ratio (the blog loss's) lies outside [0.8, 1.2];
- ESS of the sequences' summed ratios, KL(sampler || trainer) per token, the mean length and length x KL (the
  regime boundary's abscissa: sequence-level ratios break down near 20).
`on` must read exactly 0 on the shares and the KL (its generator and trainer are the same bits): the script exits
non-zero where it does not. Output: <out-dir>/frozen.csv (long: arm, length, loss, seed, metric, value) and
<out-dir>/frozen.md (the table), both printed where --out-dir is given too.

    python bench/probe_frozen.py [--policy DIR] [--lengths 256 512 1024] [--steps 5] [--losses grpo blog]
        [--workers 3] [--out-dir runs/frozen]
    python bench/probe_frozen.py --smoke       # CPU: the tiny self-trained policy, 4 tokens, 1 step
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pandas as pd

from workbench.onoff.config import preset
from workbench.onoff.probe import probe
from workbench.onoff.runner import starting_policy

METRICS = {"token_ratio_outside_0.2": "token clip share", "seq_sum_ratio_outside_0.2": "sequence clip share",
           "is_ess": "ESS", "sampler_trainer_kl": "KL / token", "response_length": "length"}
"""What the probe reports, and its column names; length x KL is added."""
MUST_BE_ZERO = ("token_ratio_outside_0.2", "seq_sum_ratio_outside_0.2", "sampler_trainer_kl")


def frozen_probe(preset_name: str, arms: tuple[str, ...], losses: tuple[str, ...], lengths: tuple[int, ...],
                 steps: int, seeds: tuple[int, ...], out_dir: Path, smoke: bool, policy: str = "",
                 workers: int = 1) -> pd.DataFrame:
    """The long table (arm, length, loss, seed, metric, value) of every arm x length x loss: each run's mean over
    its `steps` steps at lr = 0. Runs already done under out_dir are not run again."""
    rows = []
    base = preset(preset_name, smoke, arms=arms, seeds=seeds, lr=0.0, workers=workers, progress=False,
                  out_dir=str(out_dir), **({"policy": policy} if policy else {}))
    start = starting_policy(base)   # one starting policy for every loss (the smoke's is trained once, here)
    for loss in losses:
        cfg = dataclasses.replace(base, loss=loss, policy=start, out_dir=str(out_dir / loss))
        probe(cfg, steps=steps, lengths=lengths)   # runs each length into <out_dir>/<loss>/L<length>
        for length in lengths:
            metrics = pd.read_csv(out_dir / loss / f"L{length}" / "metrics.csv")
            metrics = metrics[metrics.metric.isin(METRICS) & (metrics.step <= steps)]
            means = metrics.groupby(["variant", "seed", "metric"], as_index=False).value.mean()
            rows.append(means.rename(columns={"variant": "arm"}).assign(length=length, loss=loss))
    table = pd.concat(rows, ignore_index=True)
    return table[["arm", "length", "loss", "seed", "metric", "value"]]


def summary(long: pd.DataFrame) -> pd.DataFrame:
    """One row per arm x length x loss: the means over the seeds, and length x KL."""
    wide = long.pivot_table(index=["loss", "length", "arm"], columns="metric", values="value", aggfunc="mean")
    wide = wide.reindex(columns=list(METRICS)).reset_index()
    wide["length x KL"] = wide["response_length"] * wide["sampler_trainer_kl"]
    return wide.rename(columns=METRICS)


def on_not_zero(long: pd.DataFrame) -> list[str]:
    """The `on` cells whose shares or KL are not exactly 0 (generator and trainer are the same bits there)."""
    on = long[(long.arm == "on") & long.metric.isin(MUST_BE_ZERO) & (long.value != 0)]
    return [f"on, length {r.length}, {r.loss}, seed {r.seed}: {r.metric} = {r.value!r}" for r in on.itertuples()]


def markdown(table: pd.DataFrame, header: str) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = [header, "", "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="regime")
    p.add_argument("--policy", default="", help="the starting policy (e.g. a warm-started folder); default: the "
                   "preset's")
    p.add_argument("--arms", nargs="+", default=["on", "off", "off-fp8"])
    p.add_argument("--losses", nargs="+", default=["grpo", "blog"])
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="max_new_tokens (default 256 512 1024; "
                   "--smoke: 4)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 5; --smoke: 1)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--workers", type=int, default=1, help="runs at once (under MPS on a GPU where it exists)")
    p.add_argument("--out-dir", default="runs/frozen")
    p.add_argument("--smoke", action="store_true", help="a CPU check of the pipeline: its numbers are no result")
    a = p.parse_args()
    lengths = tuple(a.lengths or ((4,) if a.smoke else (256, 512, 1024)))
    steps = a.steps or (1 if a.smoke else 5)
    out = Path(a.out_dir)
    long = frozen_probe(a.preset, tuple(a.arms), tuple(a.losses), lengths, steps, tuple(a.seeds), out, a.smoke,
                        a.policy, a.workers)
    long.to_csv(out / "frozen.csv", index=False)
    text = markdown(summary(long), f"Frozen-policy probe (lr = 0): preset `{a.preset}`{' (smoke)' if a.smoke else ''}"
                    f", seeds {list(a.seeds)}, means over steps 1-{steps}; shares outside [0.8, 1.2]")
    (out / "frozen.md").write_text(text + "\n")
    print(text)
    bad = on_not_zero(long)
    if bad:
        print("FAILED: `on` must read exactly 0:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:   # a bad preset, arm or setting: the one line that says which
        raise SystemExit(f"probe_frozen: {e}") from None

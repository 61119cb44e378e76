"""The figures of plots.py read cleanly: whole numbers where the quantity is a count, a one-step sweep's axis at its
step, no legend over the bars. (Each was drawn and looked at; these pin what was fixed.)"""

from __future__ import annotations

import numpy as np
import pandas as pd

from workbench.plots import audit_heatmap, logprob_diff_histogram, sweep_comparison


def _sweep(steps: list[int]) -> pd.DataFrame:
    rows = [{"point": f"lr={lr},seed={seed}", "step": s, "metric": "reward_mean", "value": 0.1 * seed + s / 100,
             "lr": lr, "seed": seed} for lr in ("1e-3", "3e-3") for seed in (0, 1) for s in steps]
    return pd.DataFrame(rows)


def test_a_one_step_sweep_shows_its_step_not_a_fractional_axis():
    left = sweep_comparison(_sweep([1]), ["lr", "seed"]).axes[0]
    assert list(left.get_xticks()) == [1]
    lo, hi = left.get_xlim()
    assert lo < 1 < hi and hi - lo >= 2
    many = sweep_comparison(_sweep(list(range(1, 21))), ["lr", "seed"]).axes[0]
    assert all(float(t).is_integer() for t in many.get_xticks())


def test_the_histogram_counts_whole_tokens_and_its_legend_covers_no_bar():
    rng = np.random.default_rng(0)
    lp = rng.normal(-2, 1, 64)
    same = pd.DataFrame({"decode": lp, "train": lp})
    off = pd.DataFrame({"decode": lp, "train": lp + rng.normal(0, 0.01, 64)})
    fig = logprob_diff_histogram({"invariant": same, "standard": off})
    ax = fig.axes[0]
    fig.canvas.draw()
    assert all(float(t).is_integer() for t in ax.get_yticks()), "seed 0"
    assert ax.get_legend() is None and len(fig.legends) == 1, "the legend sits above the axes"
    flat = logprob_diff_histogram({"invariant": same, "standard": same.copy()}).axes[0]
    lo, hi = flat.get_xlim()
    assert lo == -hi, "with nothing to histogram, the zero line is in the middle"
    assert len(flat.get_yticks()) == 0


def test_the_audit_colour_bar_counts_whole_ulps():
    table = pd.DataFrame({"op": ["linear", "linear", "entropy", "entropy"], "mode": ["standard"] * 4,
                          "rows": [1, 33, 1, 33], "max_ulp": [0, 0, 0, 1]})
    fig = audit_heatmap(table)
    fig.canvas.draw()
    bar = fig.axes[1]
    ticks = [t for t in bar.get_yticks() if 0 <= t <= 1]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks

"""The figures of plots.py read cleanly: whole numbers where the quantity is a count, a one-step sweep's axis at its
step, no legend over the bars. (Each was drawn and looked at; these pin what was fixed.)"""

from __future__ import annotations

import numpy as np
import pytest
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


# The ON/OFF figures: both arms visible when one lies exactly on the other, tick labels apart, notes off the lines.

def _onoff(kl_off: list[float], reward_off=None, variants=("on", "off")) -> pd.DataFrame:
    rows = []
    for v in variants:
        for s, kl in enumerate(kl_off, 1):
            reward = (reward_off or [0.125, 0.0] * len(kl_off))[s - 1] if v != "on" else [0.125, 0.0][(s - 1) % 2]
            rows += [{"step": s, "metric": "reward_mean", "value": reward, "variant": v, "seed": 0},
                     {"step": s, "metric": "sampler_trainer_kl", "value": 0.0 if v == "on" else kl, "variant": v,
                      "seed": 0}]
    return pd.DataFrame(rows)


def _renderer(fig):
    """The figure drawn on an Agg canvas (a bare `Figure` has none that lays out text)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _boxes(fig, texts):
    renderer = _renderer(fig)
    return [t.get_window_extent(renderer) for t in texts if t.get_text()]


def test_identical_arms_read_as_two_and_are_named_identical():
    from workbench.onoff.figures import reward_curves

    fig = reward_curves(_onoff([1e-4, 2e-4]))   # off's reward is on's at every step
    lines = [line for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]
    assert len(lines) == 2
    a, b = lines
    assert np.array_equal(a.get_ydata(), b.get_ydata())
    assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker()), "told apart by style"
    assert a.get_linewidth() > b.get_linewidth(), "the one beneath is wider, so it shows around the one on top"
    assert "identical to on (bitwise) at every step" in fig._supxlabel.get_text()
    other = reward_curves(_onoff([1e-4, 2e-4], reward_off=[0.1, 0.2]))
    assert "identical" not in other._supxlabel.get_text(), "only equal curves are called identical"


def test_the_exactly_zero_note_is_a_legend_clear_of_the_lines():
    from workbench.onoff.figures import mismatch_panels

    fig = mismatch_panels(_onoff([1e-4, 2e-4, 4e-4, 8e-4]))
    renderer = _renderer(fig)
    ax = fig.axes[0]
    notes = [leg for leg in ax.findobj(lambda o: type(o).__name__ == "Legend")
              if any("exactly 0" in t.get_text() for t in leg.get_texts())]
    assert notes, "the note is there"
    box = notes[0].get_window_extent(renderer)
    for line in ax.get_lines():
        points = ax.transData.transform(np.column_stack([line.get_xdata(), line.get_ydata()]))
        points = points[np.isfinite(points).all(axis=1)]
        assert not any(box.contains(x, y) for x, y in points), "no point of a line under the note"


@pytest.mark.parametrize("kls", [[3e-5], [1.1e-5, 2.3e-5, 4.8e-5], [1e-12, 0.5], [1e-4, 3e-4, 3e-3, 3e-2, 0.3]],
                         ids=["one", "narrow", "wide", "blog-dose"])
def test_the_dose_figure_tick_labels_do_not_overprint(kls):
    from workbench.onoff.comparison_figures import dose_response_figure
    from workbench.onoff.stats import dose_response

    arms = ["on", *(f"noise={0.01 * (i + 1)}" for i in range(len(kls)))]
    rows = [{"step": s, "metric": m, "value": v, "variant": arm, "seed": 0}
            for arm, kl in zip(arms, [0.0, *kls]) for s in (1, 2)
            for m, v in (("reward_mean", 0.1 + s / 100), ("sampler_trainer_kl", kl))]
    fig = dose_response_figure(dose_response(pd.DataFrame(rows)))
    for ax in fig.axes:
        boxes = sorted(_boxes(fig, ax.get_xticklabels()), key=lambda b: b.x0)
        assert len(boxes) >= 2, "0 (on) and at least one KL"
        assert all(left.x1 <= right.x0 for left, right in zip(boxes, boxes[1:])), [t.get_text() for t in
                                                                                 ax.get_xticklabels()]


def test_the_audit_labels_blank_cells_and_shows_the_matmul_batch_variance():
    table = pd.DataFrame({"op": ["linear"] * 2 + ["attention"], "mode": ["standard"] * 3, "rows": [1, 64, 1],
                          "max_ulp": [0, 0, 0]})
    matmul = pd.DataFrame({"dtype": ["bfloat16"] * 2 + ["float32"] * 2, "M": [1, 64] * 2,
                           "standard_max_ulps": [0, 1, 0, 58368], "invariant_max_ulps": [0] * 4})
    fig = audit_heatmap(table, matmul=matmul)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "n/a" in texts, "attention at M=64 was not measured and says so"
    assert "1" in texts and "58368" in texts, "the product's batch variance is in the figure"
    assert "linear is 0 above" in fig._supxlabel.get_text()

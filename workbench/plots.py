"""Figures drawn only from the long tables the runs write, never from notebook state.

Each function takes a table and returns a matplotlib `Figure` (no pyplot global state);
`save_figure` writes it as SVG (for a blog post) and PNG (a quick look).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import Normalize, SymLogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

# ON = invariant (generator = trainer bitwise), OFF = standard (the usual mismatched kernels); on a CPU the
# standard kernels in fp32 are the control that shows the mismatch (notebooks 02 and 03).
COLORS = {"invariant": "#1b7837", "standard": "#c51b7d", "standard fp32": "#e08214"}
LABELS = {"invariant": "invariant (ON)", "standard": "standard (OFF)",
          "standard fp32": "standard, fp32 (CPU control)"}
TITLES = {"reward_mean": "reward", "accuracy": "accuracy", "reward_positive": "share with reward > 0",
          "entropy": "entropy (nats)", "sampler_trainer_kl": "KL(sampler || trainer)",
          "parity_tokens_differing": "tokens differing", "parity_max_abs_diff": "max |Δ log-prob|",
          "kl": "KL penalty (kl_to)"}


def save_figure(fig: Figure, folder: str | Path, name: str, svg: bool = True, dpi: int = 150) -> list[Path]:
    """Write `name`.png at `dpi` (and `name`.svg, the one people take into posts, unless svg=False) into folder;
    returns the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.svg"] if svg else []
    if svg:
        fig.savefig(paths[0], bbox_inches="tight")
    paths.append(folder / f"{name}.png")
    fig.savefig(paths[-1], bbox_inches="tight", dpi=dpi)
    return paths


def _ulp_grid(ax, grid: pd.DataFrame, fig, label: str):
    """One heatmap of whole ulps: a number in every measured cell, "n/a" in the others; returns its colour bar."""
    values = grid.to_numpy(dtype=float)
    vmax = max(1.0, float(np.nanmax(values))) if np.isfinite(values).any() else 1.0
    # fp32's ulps run to 10^4 where bf16's are 1: a log scale past 1 ulp keeps a single ulp visible beside them.
    norm = SymLogNorm(linthresh=1, linscale=0.5, vmin=0, vmax=vmax, base=10) if vmax > 50 else Normalize(0, vmax)
    image = ax.imshow(values, cmap="Reds", norm=norm, aspect="auto")
    for i, j in zip(*np.nonzero(~np.isnan(values))):
        ax.text(j, i, f"{int(values[i, j])}", ha="center", va="center", fontsize=8,
                color="white" if norm(values[i, j]) > 0.5 else "black")
    for i, j in zip(*np.nonzero(np.isnan(values))):
        ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="0.5")
    ax.set_yticks(range(grid.shape[0]), grid.index, fontsize=9)
    bar = fig.colorbar(image, ax=ax, label=label)
    if isinstance(norm, Normalize) and not isinstance(norm, SymLogNorm):
        bar.locator = MaxNLocator(integer=True)   # ulps are whole numbers
        bar.update_ticks()
    return bar


def audit_heatmap(table: pd.DataFrame, title: str = "batch invariance per op", note: str = "",
                  matmul: pd.DataFrame | None = None) -> Figure:
    """Ops x (mode, batch size): the largest ulp distance of a row in a batch vs the row alone (0 = bitwise).
    `note` goes under the figure: what a control column is (a mode label may name a dtype, in whose ulps it
    counts). `matmul`, notebook 01's `demo.batch_variance` table (one product at its own width, batches of M rows),
    adds a panel below: where the audit's shapes happen to show no batch variance in a product, that one may."""
    # An op whose batches stop short of an M (attention rows are whole sequences) leaves that cell "n/a".
    grid = table.pivot_table(index="op", columns=["mode", "rows"], values="max_ulp", aggfunc="max")
    rows = [grid]
    if matmul is not None and not matmul.empty:
        long = pd.concat([matmul.assign(mode=m, ulps=matmul[f"{m}_max_ulps"]) for m in ("invariant", "standard")])
        wide = long.pivot_table(index=["mode", "dtype"], columns="M", values="ulps", aggfunc="max")
        wide.index = [f"matmul, {m}, {d}" for m, d in wide.index]
        rows.append(wide)
    heights = [0.45 * r.shape[0] + 0.9 for r in rows]
    width = max(1.0 + 0.7 * grid.shape[1], 1.0 + 0.55 * rows[-1].shape[1] + 1.5)
    fig = Figure(figsize=(width, sum(heights) + 0.4), layout="constrained")
    axes = fig.subplots(len(rows), 1, height_ratios=heights, squeeze=False)[:, 0]
    _ulp_grid(axes[0], grid, fig, "max ulp distance to the row alone\n(in the column's dtype)")
    # A word a line: "standard fp32" is wider than its column.
    axes[0].set_xticks(range(grid.shape[1]), ["\n".join([*str(m).split(), f"M={r}"]) for m, r in grid.columns],
                       fontsize=8)
    axes[0].set_title(f"{title} (0 everywhere = bitwise)", fontsize=10)
    notes = [note] if note else []
    if np.isnan(grid.to_numpy(dtype=float)).any():
        notes.append("n/a: not measured at that batch size (an attention row is a whole sequence, so its batches "
                     "stop at fewer rows)")
    if len(rows) > 1:
        wide = rows[1]
        _ulp_grid(axes[1], wide, fig, "max ulps of row 0\nvs row 0 alone")
        axes[1].set_xticks(range(wide.shape[1]), [f"M={m}" for m in wide.columns], fontsize=8)
        axes[1].set_title("one product x[:M] @ W.T (notebook 01): row 0 inside a batch of M vs alone", fontsize=9)
        linear = table[(table.op == "linear") & (table["mode"] == "standard")]
        if len(linear) and (linear.max_ulp == 0).all():
            notes.append("linear is 0 above: at the audit's shapes the standard product happened to run one kernel "
                         "for every M; the product below did not")
        notes.append("matmul: the standard product's kernel choice follows M (ulps in its dtype), the invariant "
                     "one's does not")
    if notes:
        fig.supxlabel("\n".join(notes), fontsize=7, color="0.35")
    return fig


def logprob_diff_histogram(tables: dict[str, pd.DataFrame], a: str = "decode", b: str = "train",
                           title: str = "") -> Figure:
    """Histogram of per-token log-prob differences (generator path a minus trainer path b), one series
    per mode; exact zeros are counted apart (they are the bitwise-equal tokens)."""
    fig = Figure(figsize=(6.5, 3.2 + 0.15 * len(tables)), layout="constrained")
    ax = fig.subplots()
    diffs = {variant: (t[a] - t[b]).to_numpy() for variant, t in tables.items()}
    # One set of bins, symmetric about 0, for every series: a series whose differences are all alike (a CPU's fp32
    # control: a few tokens 1 ulp apart) would otherwise get a bin a unit wide around them.
    widest = max((float(np.abs(d).max()) for d in diffs.values() if len(d)), default=0.0)
    bins = np.linspace(-1.05 * widest, 1.05 * widest, 41)
    for variant, diff in diffs.items():
        zeros = int((diff == 0).sum())
        nonzero = diff[diff != 0]
        label = f"{LABELS.get(variant, variant)}: {zeros}/{len(diff)} tokens exactly equal"
        if len(nonzero):
            ax.hist(nonzero, bins=bins, alpha=0.6, color=COLORS.get(variant), label=label)
        else:
            ax.axvline(0, color=COLORS.get(variant), lw=2, label=label)
    if all(((t[a] - t[b]) == 0).all() for t in tables.values()):
        ax.set_xlim(-1, 1)   # the zero line in the middle, not at the edge of an empty 0..1 axis
        ax.text(0.5, 0.5, "every token's log-prob is exactly equal in every mode:\nno difference to histogram "
                "(on a CPU the standard kernels match here too)", transform=ax.transAxes, ha="center",
                va="center", fontsize=8, color="0.35", backgroundcolor="white")
    ax.set_xlabel(f"log-prob({a}) - log-prob({b})")
    ax.set_ylabel("tokens")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))   # counts
    if not ax.patches:   # only the lines at 0: no count to read off an axis (the legend has them)
        ax.set_yticks([])
        ax.set_ylabel("")
    # Above the axes, so that it covers no bar; the title heads it (a suptitle would overlap it).
    fig.legend(loc="outside upper center", fontsize=8, ncols=2 if len(tables) == 2 else 1, frameon=False,
               title=title or None, title_fontsize=10)
    ax.grid(alpha=0.3)
    return fig


def sweep_comparison(table: pd.DataFrame, fields: list[str], metric: str = "reward_mean") -> Figure:
    """A sweep's `metric` per grid point (the `point` column): its curve over the steps (left) and its value at the
    last step (right: a dot per point, a dash at the mean). The first swept field other than the seed is the
    right panel's x-axis, the next one (else the same) the colour in both; points that differ only in further
    fields (seeds) are replicates. A point's several runs (arms, seeds of an on-off point) are averaged."""
    rows = table[table.metric == metric]
    curves = rows.groupby(["point", "step"], sort=False).value.mean().reset_index()
    final = curves[curves.step == curves.groupby("point").step.transform("max")].set_index("point").value
    keys = rows.drop_duplicates("point").set_index("point")[list(fields)].astype(str)
    main = [f for f in fields if f not in ("seed", "seeds")] or list(fields)
    x_field = main[0] if main else None
    hue_field = main[1] if len(main) > 1 else x_field
    x_of = keys[x_field] if x_field else pd.Series("all", index=keys.index)
    hue_of = keys[hue_field] if hue_field else x_of
    xs, hues = list(dict.fromkeys(x_of)), list(dict.fromkeys(hue_of))
    palette = colormaps["tab10"]
    color = {h: palette(i % 10) for i, h in enumerate(hues)}
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    # With a colour field of its own, the x field's values are told apart on the left by the line style.
    styles = ("-", "--", ":", "-.")
    style = {x: styles[i % len(styles)] if hue_field != x_field else "-" for i, x in enumerate(xs)}
    for point, c in curves.groupby("point", sort=False):
        left.plot(c.step, c.value, color=color[hue_of[point]], ls=style[x_of[point]], lw=1.2, alpha=0.8,
                  marker="o" if len(c) < 3 else None, ms=3)
    if hue_field != x_field:
        left.legend(handles=[Line2D([], [], color="0.3", ls=style[x], label=x) for x in xs], title=x_field,
                    fontsize=8, title_fontsize=8)
    width = 0.7 / len(hues) if hue_field != x_field else 0.7
    for (x, h), group in final.groupby([x_of, hue_of], sort=False):
        pos = xs.index(x) + ((hues.index(h) - (len(hues) - 1) / 2) * width if hue_field != x_field else 0)
        right.scatter([pos] * len(group), group, color=color[h], s=18, zorder=3)
        right.hlines(group.mean(), pos - 0.4 * width, pos + 0.4 * width, color=color[h], lw=2)
    right.set_xticks(range(len(xs)), [f"{x_field}={x}" if x_field else x for x in xs], fontsize=8,
                     rotation=30 if len(xs) > 4 else 0)
    title = TITLES.get(metric, metric)
    left.set(xlabel="step", ylabel=title, title=f"{title} per grid point")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = sorted(curves.step.unique())
    if len(steps) == 1:   # one step: its number, not a fractional axis around it
        left.set_xticks(steps)
        left.set_xlim(steps[0] - 1, steps[0] + 1)
    right.set(ylabel=title, title=f"{title} at the last step (dash: mean)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    if hue_field:
        handles = [Line2D([], [], color=color[h], lw=2, label=h) for h in hues]
        right.legend(handles=handles, title=hue_field, fontsize=8, title_fontsize=8)
    return fig

"""Figures of the calibrated comparison, drawn from `stats`' summary tables: the dose-response over the `noise=`
arms (`stats.dose_response`), the regime map over lengths and losses (`stats.regime_table`), and the pre-registered
map over T x KL (`regime_plan.map_table`), each effect with its 95% paired t-interval (`paired`). The long table's
per-step figures are in `figures`, with the arm colours and labels that these share.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedFormatter, FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

from .figures import NOTE_STYLE, arm_colors, arm_label
from .paired import ALPHA, t_interval
from .regime_plan import BOUNDARIES, MISMATCH, STEPS, WINDOW
from .stats import REFERENCE, dose_slope, final_steps

_SERIES = ("#c51b7d", "#0072b2", "#e69f00", "#009e73", "#56b4e9", "#d55e00")  # the regime map's (arm, loss) lines


def _zero_axis(ax, zero_at: float, smallest: float, largest: float) -> None:
    """Log x ticks with KL 0 drawn at `zero_at`, left of a dotted break before the smallest positive KL.

    Labels at least an eighth of the axis apart (a label such as "2e-5" is about that wide, so none overprints
    another or "0 (on)"): decades (1-2-5 steps within a decade or two), thinned from the left; with no such tick in
    range (one KL, or a narrow spread), the smallest KL itself.
    """
    cut = np.sqrt(zero_at * smallest)
    ax.axvline(cut, color="0.6", lw=0.8, ls=":")
    margin = 10 ** (0.05 * np.log10(largest / zero_at))  # the outermost points a little inside the frame
    left, right = zero_at / max(1.6, margin), largest * max(1.6, margin)
    ax.set_xlim(left, right)
    decades = np.log10(largest / smallest)
    subs = (1.0, 2.0, 5.0) if decades < 1 else (1.0,)
    candidates = [t for t in LogLocator(subs=subs).tick_values(smallest, right) if cut < t <= right]
    gap = np.log10(right / left) / 8
    ticks = []
    for t in candidates:
        if np.log10(t / (ticks[-1] if ticks else zero_at)) >= gap:
            ticks.append(t)
    if not ticks and np.log10(smallest / zero_at) >= gap:
        ticks = [smallest]
    labels = [f"{t:.0e}".replace("e-0", "e-") for t in ticks]
    ax.xaxis.set_major_locator(FixedLocator([zero_at, *ticks]))
    ax.xaxis.set_major_formatter(FixedFormatter(["0 (on)", *labels]))
    ax.xaxis.set_minor_locator(NullLocator())  # minor ticks would suggest a scale across the break


def dose_response_figure(dose: pd.DataFrame) -> Figure:
    """Final reward (and AUC) vs the measured KL(sampler || trainer) of the `noise=` arms and `on`.

    A point per run; per arm its mean with the 95% t-interval over seeds; and one OLS line of the endpoint on
    log10 KL over the noise arms' runs (`stats.dose_slope`, its slope and CI in the panel). `on`'s KL is 0, which a
    log axis cannot show: it is drawn left of a break, labelled "0 (on)", and is not in the fit.
    """
    if dose.empty:
        raise ValueError("the dose-response table is empty")
    kl = dose.kl_mean.to_numpy(dtype=float)
    positive = kl[np.isfinite(kl) & (kl > 0)]
    # "0 (on)" sits a quarter of the positive KLs' span (at least half a decade) left of the smallest.
    zero_at = positive.min() / 10 ** max(0.5, 0.25 * np.log10(positive.max() / positive.min())) \
        if positive.size else None

    def place(x):
        x = np.asarray(x, dtype=float)
        return x if zero_at is None else np.where(np.isfinite(x) & (x <= 0), zero_at, x)

    window, steps = dose.attrs.get("window"), dose.attrs.get("steps")
    last = final_steps(steps, window) if window and steps else window
    ylabels = {"final_reward": f"final reward (last {last} step{'' if last == 1 else 's'})" if last else "final reward",
               "auc": "AUC (mean reward over all steps)"}
    colors = arm_colors(dose.variant)
    fig = Figure(figsize=(9.0, 3.8), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, y in zip(axes, ylabels):
        for variant, arm in dose.groupby("variant", sort=False):
            ax.scatter(place(arm.kl_mean), arm[y], s=12, alpha=0.4, color=colors[variant], lw=0)
            y_mean = arm[y].mean()
            y_lo, y_hi = (float(v[0]) for v in t_interval(arm[y].to_numpy(dtype=float)[None, :]))
            yerr = None if np.isnan([y_lo, y_hi]).any() else [[y_mean - y_lo], [y_hi - y_mean]]
            ax.errorbar(place(arm.kl_mean.mean()), y_mean, yerr=yerr, fmt="D" if variant == REFERENCE else "o",
                        ms=6, capsize=2, color=colors[variant], label=arm_label(variant))
        fit = dose_slope(dose, y)
        if np.isfinite(fit["slope"]):
            xs = np.geomspace(fit["kl_lo"], fit["kl_hi"], 50)
            ax.plot(xs, fit["intercept"] + fit["slope"] * np.log10(xs), color="0.3", lw=1, ls="--",
                    label="OLS fit on log10 KL (noise arms)")
            ax.set_title(f"OLS slope {fit['slope']:.2g} per decade of KL [{fit['lo']:.2g}, {fit['hi']:.2g}], "
                         f"p = {fit['p']:.1g}", fontsize=9)
        if zero_at is not None:
            ax.set_xscale("log")
            _zero_axis(ax, zero_at, positive.min(), positive.max())
        ax.set_xlabel("measured KL(sampler || trainer) / token")
        ax.set_ylabel(ylabels[y])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("final reward vs measured sampler-trainer KL (dose-response over injected noise)", fontsize=10)
    fig.supxlabel("points: runs; markers with bars: arm mean and 95% t-interval over seeds; KL: mean over steps\n"
                  "dashed: one OLS fit over the noise arms' runs (`on`, at KL 0, is not in it); slope per decade with "
                  "its 95% CI"
                  + ("" if positive.size else "; no positive KL measured, so the x-axis is linear"), **NOTE_STYLE)
    return fig


def regime_map(summary_table: pd.DataFrame) -> Figure:
    """The regime map from `stats.regime_table`: per (generation length, loss) cell, reward arm - reference with
    its 95% paired t-interval (filled marker: resolved by the calibrated rule, hollow: not, x: not resolvable with
    the cell's seeds), and the mismatch there: KL/token, and the SD of the sequence log-ratio where logged (else
    the clip fraction). One line per (arm, loss) along the lengths."""
    t = summary_table
    if t.empty:
        raise ValueError("the regime table is empty")
    reference = t.attrs.get("reference", REFERENCE)
    spread = "seq_logratio_sd" if t.seq_logratio_sd.notna().any() else "clip_fraction"
    panels = (("d_final_reward", f"final reward − {reference} (95% paired t-CI)"),
              ("kl_mean", "KL(sampler || trainer) / token"),
              (spread, "SD of the sequence log-ratio" if spread == "seq_logratio_sd" else "clip fraction"))
    fig = Figure(figsize=(12.6, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    lengths = sorted(set(t.max_new_tokens))
    series = list(t.groupby(["variant", "loss"], sort=False))
    for i, ((variant, loss), rows) in enumerate(series):
        rows = rows.sort_values("max_new_tokens")
        color, label = _SERIES[i % len(_SERIES)], f"{variant}, {loss}"
        # Lines of one arm over the losses side by side: a small shift keeps their bars apart.
        x = rows.max_new_tokens.to_numpy(dtype=float) * 2 ** (0.06 * (i - (len(series) - 1) / 2))
        for ax, (col, _) in zip(axes, panels):
            ax.plot(x, rows[col], color=color, lw=1, alpha=0.7, label=label if ax is axes[0] else None)
        d = rows.d_final_reward.to_numpy(dtype=float)
        err = np.abs([d - rows.d_final_reward_lo.to_numpy(float), rows.d_final_reward_hi.to_numpy(float) - d])
        axes[0].errorbar(x, d, yerr=np.where(np.isfinite(err), err, 0), fmt="none", color=color, capsize=2)
        resolvable = rows.d_final_reward_floor <= t.attrs.get("alpha", ALPHA)
        for xi, di, res, ok in zip(x, d, rows.d_final_reward_resolved, resolvable):
            axes[0].plot(xi, di, "o" if ok else "x", ms=6, color=color, mfc=color if res else "white")
        for ax, (col, _) in zip(axes[1:], panels[1:]):
            ax.plot(x, rows[col], "o", ms=4, color=color)
    axes[0].axhline(0, color="0.5", lw=0.8)
    for ax, (col, name) in zip(axes, panels):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(lengths))
        ax.xaxis.set_major_formatter(FixedFormatter([f"{v:g}" for v in lengths]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("max new tokens")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    if t.kl_mean.gt(0).any():
        axes[1].set_yscale("log")
    fig.legend(loc="outside upper center", ncols=min(4, len(series)), fontsize=8, frameon=False)
    fig.supxlabel(f"filled: resolved (exact sign-flip p, Holm over all {len(t)} cells, <= "
                  f"{t.attrs.get('alpha', ALPHA):g} and the t-CI excludes 0); hollow: not resolved; x: not resolvable "
                  "with the cell's seeds; mismatch: means over the arm's runs", **NOTE_STYLE)
    return fig


def plan_map(table: pd.DataFrame) -> Figure:
    """The pre-registered regime map from `regime_plan.map_table`: per tested cell, final reward dose - `on` (its
    95% paired t-interval) at the T x KL its dose runs measured (log axis), one panel per loss; `on` is 0 by
    construction. Filled: resolved by the plan's rule (Holm within the cell's family); hollow: not; x: not
    resolvable with its seeds and family. Dotted lines: the predicted boundaries (H1 at 3, the literature's 20)."""
    tested = table[table.tested.astype(bool)]
    drawn = tested[np.isfinite(tested.t_x_kl) & (tested.t_x_kl > 0)]
    if drawn.empty:
        raise ValueError("no tested cell with a measured T x KL to draw: map_table's status says what is missing")
    losses = list(dict.fromkeys(drawn.loss))
    colors = arm_colors(drawn.arm)
    fig = Figure(figsize=(4.6 * len(losses) + 0.6, 4.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(losses), sharey=True))
    lo_x = min(drawn.t_x_kl.min(), min(BOUNDARIES.values())) / 2
    hi_x = max(drawn.t_x_kl.max(), max(BOUNDARIES.values())) * 2
    alpha = table.attrs.get("alpha", ALPHA)
    for ax, loss in zip(axes, losses):
        for row in drawn[drawn.loss == loss].itertuples():
            color = colors[row.arm]
            err = [[row.d - row.lo], [row.hi - row.d]] if np.isfinite([row.lo, row.hi]).all() else None
            ax.errorbar(row.t_x_kl, row.d, yerr=err, fmt="none", color=color, capsize=2)
            ax.plot(row.t_x_kl, row.d, "o" if row.floor <= alpha else "x", ms=7, color=color,
                    mfc=color if row.resolved else "white")
            ax.annotate(f"{row.name} ({row.max_new_tokens})", (row.t_x_kl, row.d), xytext=(4, 4),
                        textcoords="offset points", fontsize=7, color=color)
        ax.axhline(0, color="0.5", lw=0.8)
        for name, x in BOUNDARIES.items():
            ax.axvline(x, color="0.4", lw=0.8, ls=":")
            ax.text(x, 1.0, f" {name}: {x:g}", transform=ax.get_xaxis_transform(), fontsize=7, va="top",
                    color="0.3")
        ax.set_xscale("log")
        # Ticks at 1 and 3 a decade, plainly written: the default labels every minor tick of a span under two
        # decades, and they overlap.
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(lo_x, hi_x)
        ax.set_title(f"loss {loss}", fontsize=10)
        ax.set_xlabel("T x KL of the dose runs (mean over steps and seeds)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"final reward dose − on (steps {table.attrs.get('steps', STEPS) - WINDOW + 1}-"
                       f"{table.attrs.get('steps', STEPS)}), 95% paired t-CI")
    for arm, color in colors.items():
        axes[-1].plot([], [], "o", color=color, label=arm_label(arm))
    axes[-1].legend(fontsize=7, loc="best")
    interim = sorted(set(table[table.interim.astype(bool) & table.tested.astype(bool)].family))
    fig.supxlabel("filled: resolved (exact sign-flip p, Holm within the cell's family, <= "
                  f"{alpha:g}, and the t-CI excludes 0); hollow: not resolved; x: not resolvable with its seeds and "
                  "family; label: cell (max new tokens)"
                  + (f"\ninterim (Bonferroni over the planned cells) in {', '.join(interim)}" if interim else "")
                  + (f"; {len(tested) - len(drawn)} tested cell(s) without a measured T x KL not drawn"
                     if len(drawn) < len(tested) else ""), **NOTE_STYLE)
    return fig


def plan_mismatch(table: pd.DataFrame) -> Figure:
    """The mismatch of each planned cell's published dose runs (`regime_plan.MISMATCH`, means over steps and seeds):
    one panel per metric, one row per cell (hollow: the cell is not complete, so not tested)."""
    shown = table[table[list(MISMATCH)].notna().any(axis=1)]
    if shown.empty:
        raise ValueError("no planned cell has published dose runs with mismatch metrics")
    fig = Figure(figsize=(2.4 * len(MISMATCH), 1.0 + 0.25 * len(shown)), layout="constrained")
    axes = fig.subplots(1, len(MISMATCH), sharey=True)
    colors = arm_colors(shown.arm)
    y = np.arange(len(shown))[::-1]
    for ax, (col, name) in zip(axes, MISMATCH.items()):
        for yi, row in zip(y, shown.itertuples()):
            color = colors[row.arm]
            ax.plot(getattr(row, col), yi, "o", ms=6, color=color, mfc=color if row.tested else "white")
        if col in ("kl_per_token", "t_x_kl") and (shown[col] > 0).any():
            ax.set_xscale("log")
        if col == "t_x_kl":
            for x in BOUNDARIES.values():
                ax.axvline(x, color="0.4", lw=0.8, ls=":")
        ax.set_title(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_yticks(y, [f"{r.name} {r.loss} {r.arm} {r.max_new_tokens}" for r in shown.itertuples()],
                       fontsize=7)
    axes[0].set_ylim(-0.7, len(shown) - 0.3)
    fig.supxlabel("the dose runs' means over steps and seeds; hollow: the cell is not complete (not tested); "
                  "dotted: T x KL 3 (H1) and 20 (the literature)", **NOTE_STYLE)
    return fig


CURVES = {"reward_mean": "reward (a trailing mean)", "entropy": "trainer's entropy per token (nats)"}
"""The rows of `plan_curves`: what a cell's endpoint averages, and the policy's state that splits its seeds."""


def plan_curves(long: pd.DataFrame, table: pd.DataFrame, smooth: int = 10) -> Figure:
    """Each planned cell with published runs of both its arms (`regime_plan.assemble`'s table `long`, the plan's
    `map_table`), one column each: every run over its steps, `on` and the dose, reward above and the trainer's entropy
    below (log axis), a trailing `smooth`-step mean. The map gives a cell one number; this shows what it averages
    (seeds that blow up beside seeds that do not). Runs cut short end where they stopped."""
    cells = []
    for r in table.itertuples():
        runs = long[(long.max_new_tokens == r.max_new_tokens) & (long.loss == r.loss)
                    & long.variant.isin(["on", r.arm])]
        if {"on", r.arm} <= set(runs.variant):
            cells.append((r, runs[runs.metric.isin(list(CURVES))]))
    if not cells:
        raise ValueError("no planned cell has published runs of both its arms")
    fig = Figure(figsize=(3.4 * len(cells) + 0.8, 5.6), layout="constrained")
    axes = fig.subplots(len(CURVES), len(cells), sharex="col", squeeze=False)
    colors = arm_colors([v for _, runs in cells for v in runs.variant.unique()])
    for j, (r, runs) in enumerate(cells):
        for i, (metric, label) in enumerate(CURVES.items()):
            ax = axes[i, j]
            for (variant, _), run in runs[runs.metric == metric].groupby(["variant", "seed"]):
                y = run.sort_values("step").set_index("step").value.rolling(smooth, min_periods=1).mean()
                ax.plot(y.index, y.to_numpy(), color=colors[variant], lw=0.9, alpha=0.8)
            if metric == "entropy":
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(f"{r.name}: {r.loss} x {r.arm}, {r.max_new_tokens} tokens"
                             + ("" if r.tested else " (incomplete)"), fontsize=9)
            if j == 0:
                ax.set_ylabel(label, fontsize=8)
            if i == len(CURVES) - 1:
                ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    fig.legend([Line2D([], [], color=c) for c in colors.values()], [arm_label(a) for a in colors],
               loc="outside upper center", ncols=len(colors), fontsize=8, frameon=False)
    fig.supxlabel(f"one line per run (seed), a trailing {smooth}-step mean; a run cut short ends where it stopped; "
                  "a cut copy that another hold finished is left out", **NOTE_STYLE)
    return fig

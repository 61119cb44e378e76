"""Figures of an ON/OFF experiment, drawn only from its long metrics table (or from per-token deltas).

Each function returns a matplotlib `Figure` (no pyplot global state), in the look of `workbench.plots`; write
it with `workbench.plots.save_figure`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter, FixedLocator, LogLocator, MaxNLocator, NullLocator

from ..plots import TITLES
from .stats import NOISE_PREFIX, REFERENCE, arm_order, bootstrap_band, bootstrap_ci, noise_sigma

# Okabe-Ito and PiYG/PRGn shades (colorblind-friendly); a vLLM arm is a lighter shade of the arm it mirrors.
COLORS = {"on": "#1b7837", "off": "#c51b7d", "off-recompute": "#0072b2", "off-tis": "#e69f00",
          "off-mis": "#56b4e9", "off-vllm": "#de77ae", "on-vllm": "#7fbf7b"}
LABELS = {"on": "on (bitwise)", "off": "off (standard kernels, old = sampler)", "off-recompute": "off-recompute",
          "off-tis": "off-tis (truncated IS)", "off-mis": "off-mis (masked IS)", "off-vllm": "off-vllm",
          "on-vllm": "on-vllm"}
# Noise arms run light to dark with sigma; purple is used by no named arm.
NOISE_COLORMAP, NOISE_SHADES = "Purples", (0.45, 0.95)
_SPARE = ("#000000", "#d55e00", "#999999", "#a6761d", "#e6ab02")  # arms this module does not know
# Per-step bands resample seeds this often: enough for a smooth 95% band, fast for 500 steps x 7 arms.
BAND_RESAMPLES = 4000
# (metric, panel title, log y-axis): the mismatch sizes span decades, counts and fractions do not.
MISMATCH_PANELS = (("parity_tokens_differing", "tokens differing", False),
                   ("parity_max_abs_diff", "max |Δ log-prob|", True),
                   ("parity_mean_abs_diff", "mean |Δ log-prob|", True),
                   ("sampler_trainer_kl", "KL(sampler || trainer)", True),
                   ("ratio_mean", "ratio mean", False),
                   ("clip_fraction", "clip fraction (low + high)", False),
                   ("is_ess", "ESS fraction", False),
                   ("grad_norm", "grad norm", False))
NOTE_STYLE = {"fontsize": 7, "color": "0.35"}


def arm_label(variant: str) -> str:
    if variant.startswith(NOISE_PREFIX):
        return f"noise σ={variant[len(NOISE_PREFIX):]}"
    return LABELS.get(variant, variant)


def arm_colors(variants) -> dict[str, str]:
    """A colour per arm: fixed for the named arms, by sigma rank from a sequential colormap for `noise=` arms."""
    arms = arm_order(variants)
    noise = sorted((a for a in arms if a.startswith(NOISE_PREFIX)), key=noise_sigma)
    shades = np.linspace(*NOISE_SHADES, len(noise)) if len(noise) > 1 else [np.mean(NOISE_SHADES)]
    colors = {a: to_hex(colormaps[NOISE_COLORMAP](s)) for a, s in zip(noise, shades)}
    others = [a for a in arms if a not in colors and a not in COLORS]
    colors.update({a: _SPARE[i % len(_SPARE)] for i, a in enumerate(others)})
    return {a: COLORS.get(a) or colors[a] for a in arms}


def _panels(count: int) -> tuple[Figure, np.ndarray]:
    """A grid of `count` panels, up to 3 a row, with room on the right for a legend of every arm."""
    cols = min(3, count)
    rows = -(-count // cols)
    fig = Figure(figsize=(4.2 * cols + 2.6, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _style_steps(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)


def _legend(fig: Figure, axes) -> None:
    """One legend right of the panels with every arm drawn in any of them (an arm may miss a metric)."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside right upper", fontsize=8)


def _by_step(rows: pd.DataFrame, smooth: int) -> pd.DataFrame:
    """step x seed values of one arm and metric, each seed smoothed by a trailing `smooth`-step average."""
    wide = rows.pivot_table(index="step", columns="seed", values="value").sort_index()
    return wide.rolling(smooth, min_periods=1).mean() if smooth > 1 else wide


def reward_curves(table: pd.DataFrame, metrics=("reward_mean",), smooth: int = 1, title: str = "",
                  note: str = "") -> Figure:
    """One panel per metric: per arm the mean over seeds per step, with a 95% bootstrap band over seeds."""
    wanted, metrics = metrics, [m for m in metrics if m in set(table.metric)]
    if not metrics:
        raise ValueError(f"none of the metrics {list(wanted)} is in the table; "
                         f"it has {sorted(set(table.metric))[:12]}")
    colors = arm_colors(table.variant)
    fig, axes = _panels(len(metrics))
    for ax, metric in zip(axes, metrics):
        arms = dict(tuple(table[table.metric == metric].groupby("variant")))
        for variant in (a for a in colors if a in arms):
            wide = _by_step(arms[variant], smooth)
            ax.plot(wide.index, wide.mean(axis=1), color=colors[variant], label=arm_label(variant), lw=1.4)
            if wide.shape[1] > 1:
                lo, hi = bootstrap_band(wide.to_numpy(), n=BAND_RESAMPLES)
                ax.fill_between(wide.index, lo, hi, color=colors[variant], alpha=0.2, lw=0)
        _style_steps(ax, TITLES.get(metric, metric))
    _legend(fig, axes)
    if title:
        fig.suptitle(title, fontsize=10)
    smoothing = f" after a trailing {smooth}-step average per seed" if smooth > 1 else ""
    how = f"line: mean over seeds{smoothing}\nband: 95% bootstrap CI of that mean per step (none with one seed)"
    fig.supxlabel(f"{how}\n{note}" if note else how, **NOTE_STYLE)
    return fig


def _with_clip_fraction(table: pd.DataFrame) -> pd.DataFrame:
    """The table plus a `clip_fraction` metric (clip_low + clip_high) where both are logged."""
    clips = table[table.metric.isin(["clip_low", "clip_high"])]
    if set(clips.metric) != {"clip_low", "clip_high"}:
        return table
    wide = clips.pivot_table(index=["variant", "seed", "step"], columns="metric", values="value")
    total = (wide.clip_low + wide.clip_high).dropna().rename("value").reset_index()
    return pd.concat([table, total.assign(metric="clip_fraction")], ignore_index=True)


def _log_panel_arm(ax, wide: pd.DataFrame, variant: str, color: str, notes: list[str]) -> bool:
    """Draw one arm on a log-y panel; an arm at exactly 0 has no place on it and gets a note instead.
    Returns whether anything was drawn."""
    values = wide.to_numpy()
    finite = values[np.isfinite(values)]
    if not finite.size:
        return False
    if (finite == 0).all():
        notes.append(f"{variant}: exactly 0 at every step")
        return False
    mean = wide.mean(axis=1)
    if (mean <= 0).any():
        notes.append(f"{variant}: 0 at {int((mean <= 0).sum())} of {len(mean)} steps (not drawn)")
    positive = wide.where(wide > 0)
    ax.plot(wide.index, mean.where(mean > 0), color=color, label=arm_label(variant), lw=1.4)
    ax.fill_between(wide.index, positive.min(axis=1), positive.max(axis=1), color=color, alpha=0.2, lw=0)
    return True


def mismatch_panels(table: pd.DataFrame, smooth: int = 1) -> Figure:
    """Sampler-trainer mismatch and update health per step, one panel per logged metric: per arm the mean over
    seeds with a min..max band. Mismatch sizes are on log axes, where an arm at exactly 0 (`on`) is a note."""
    table = _with_clip_fraction(table)
    panels = [p for p in MISMATCH_PANELS if p[0] in set(table.metric)]
    if not panels:
        raise ValueError(f"no mismatch metric ({[p[0] for p in MISMATCH_PANELS]}) is in the table")
    colors = arm_colors(table.variant)
    fig, axes = _panels(len(panels))
    for ax, (metric, title, log) in zip(axes, panels):
        arms = dict(tuple(table[table.metric == metric].groupby("variant")))
        notes, drawn = [], False
        for variant in (a for a in colors if a in arms):
            wide = _by_step(arms[variant], smooth)
            if log:
                drawn |= _log_panel_arm(ax, wide, variant, colors[variant], notes)
            else:
                ax.plot(wide.index, wide.mean(axis=1), color=colors[variant], label=arm_label(variant), lw=1.4)
                if wide.shape[1] > 1:
                    ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=colors[variant],
                                    alpha=0.2, lw=0)
        if log and drawn:  # a log axis with nothing positive on it has no range to show
            ax.set_yscale("log")
        if notes:
            ax.text(0.02, 0.02, "\n".join(notes), transform=ax.transAxes, va="bottom", **NOTE_STYLE)
        _style_steps(ax, title)
    _legend(fig, axes)
    fig.supxlabel("line: mean over seeds; band: min..max over seeds", **NOTE_STYLE)
    return fig


def delta_histogram(deltas: dict[str, np.ndarray]) -> Figure:
    """Per-token |Δ log-prob| (sampler - trainer) per named series, on log-spaced bins shared by all series.

    Exact zeros (bitwise-equal tokens) have no place on a log axis, so they are counted in the legend; a series
    with nothing but zeros gets a note instead of bars.
    """
    if not deltas:
        raise ValueError("no series to draw")
    series = {name: np.abs(np.asarray(d, dtype=float).ravel()) for name, d in deltas.items()}
    series = {name: d[np.isfinite(d)] for name, d in series.items()}
    nonzero = np.concatenate([d[d > 0] for d in series.values()])
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    notes = []
    if nonzero.size:
        lo, hi = nonzero.min(), nonzero.max()
        bins = np.geomspace(lo / 2, hi * 2, 42) if lo == hi else np.geomspace(lo, hi, 41)
        ax.set_xscale("log")
    # A series named after an arm ("off (SmolLM2-135M, standard)") takes the arm's colour, unless one already has.
    used, spare = set(), iter(_SPARE)
    for name, d in series.items():
        arm = name.split(" ")[0]
        color = COLORS[arm] if arm in COLORS and arm not in used else next(spare, None)
        used.add(arm)
        zeros = int((d == 0).sum())
        if not len(d):
            notes.append(f"{name}: no tokens")
        elif zeros < len(d):
            ax.hist(d[d > 0], bins=bins, alpha=0.5, color=color,
                    label=f"{name}: {zeros} of {len(d)} tokens exactly equal")
        else:
            notes.append(f"{name}: all {len(d)} tokens exactly equal (nothing to draw on a log axis)")
    for note in notes:  # legend entries without a mark, so they cannot cover the bars
        ax.plot([], [], " ", label=note)
    ax.set_xlabel("|log-prob(sampler) - log-prob(trainer)| per token")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def _zero_axis(ax, zero_at: float, smallest: float, largest: float) -> None:
    """Log x ticks with KL 0 drawn at `zero_at`, left of a dotted break before the smallest positive KL."""
    cut = np.sqrt(zero_at * smallest)
    ax.axvline(cut, color="0.6", lw=0.8, ls=":")
    ax.set_xlim(zero_at / 1.6, largest * 1.6)
    # Decades only when the KLs span several, else 1-2-5 steps so that at least a couple of ticks show.
    subs = (1.0,) if largest / smallest > 100 else (1.0, 2.0, 5.0)
    ticks = [t for t in LogLocator(subs=subs).tick_values(smallest, largest * 1.6) if cut < t <= largest * 1.6]
    ax.xaxis.set_major_locator(FixedLocator([zero_at, *ticks]))
    ax.xaxis.set_major_formatter(FixedFormatter(["0 (on)", *(f"{t:.3g}" for t in ticks)]))
    ax.xaxis.set_minor_locator(NullLocator())  # minor ticks would suggest a scale across the break


def dose_response_figure(dose: pd.DataFrame) -> Figure:
    """Final reward (and AUC) vs the measured KL(sampler || trainer) of the `noise=` arms and `on`.

    A point per run, and per arm its mean with 95% bootstrap CIs over seeds on both axes. `on`'s KL is 0, which
    a log axis cannot show: it is drawn at the left edge (0.3x the smallest positive KL), labelled "0 (on)".
    """
    if dose.empty:
        raise ValueError("the dose-response table is empty")
    kl = dose.kl_mean.to_numpy(dtype=float)
    positive = kl[np.isfinite(kl) & (kl > 0)]
    zero_at = 0.3 * positive.min() if positive.size else None

    def place(x):
        x = np.asarray(x, dtype=float)
        return x if zero_at is None else np.where(np.isfinite(x) & (x <= 0), zero_at, x)

    window = dose.attrs.get("window")
    ylabels = {"final_reward": f"final reward (last {window} steps)" if window else "final reward",
               "auc": "AUC (mean reward over all steps)"}
    colors = arm_colors(dose.variant)
    fig = Figure(figsize=(9.0, 3.4), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, y in zip(axes, ylabels):
        for variant, arm in dose.groupby("variant", sort=False):
            ax.scatter(place(arm.kl_mean), arm[y], s=12, alpha=0.4, color=colors[variant], lw=0)
            x_mean, y_mean = place(arm.kl_mean.mean()), arm[y].mean()
            (x_lo, x_hi), (y_lo, y_hi) = place(bootstrap_ci(arm.kl_mean)), bootstrap_ci(arm[y])
            # A percentile interval need not hold the mean in degenerate resamples; a bar cannot be negative.
            xerr = np.maximum(0, [[x_mean - x_lo], [x_hi - x_mean]])
            yerr = np.maximum(0, [[y_mean - y_lo], [y_hi - y_mean]])
            ax.errorbar(x_mean, y_mean, xerr=None if np.isnan(xerr).any() else xerr,
                        yerr=None if np.isnan(yerr).any() else yerr, fmt="D" if variant == REFERENCE else "o", ms=6,
                        capsize=2, color=colors[variant], label=arm_label(variant))
        if zero_at is not None:
            ax.set_xscale("log")
            _zero_axis(ax, zero_at, positive.min(), positive.max())
        ax.set_xlabel("measured KL(sampler || trainer), mean over steps")
        ax.set_ylabel(ylabels[y])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("final reward vs measured sampler-trainer KL (dose-response over injected noise)", fontsize=10)
    fig.supxlabel("points: runs; markers with bars: arm mean and 95% bootstrap CI over seeds (x and y)"
                  + ("" if positive.size else "; no positive KL measured, so the x-axis is linear"), **NOTE_STYLE)
    return fig

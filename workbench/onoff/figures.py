"""Figures of an ON/OFF experiment, drawn only from its long metrics table (or from per-token deltas), and the arm
colours and labels that every ON/OFF figure shares.

Each function returns a matplotlib `Figure` (no pyplot global state), in the look of `workbench.plots`; write
it with `workbench.plots.save_figure`. Per-step bands are BCa bootstrap intervals over seeds (`scipy.stats.
bootstrap`), a display of spread; the calibrated comparison is `paired.compare_paired`'s, shown by
`comparison_figures` (the dose-response and the regime map) as t-intervals.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, ScalarFormatter
from scipy import stats

from ..plots import TITLES
from .paired import LEVEL
from .stats import NOISE_PREFIX, arm_order, noise_sigma

# Okabe-Ito and PiYG/PRGn shades (colorblind-friendly); a vLLM arm is a lighter shade of the arm it mirrors.
COLORS = {"on": "#1b7837", "off": "#c51b7d", "off-recompute": "#0072b2", "off-tis": "#e69f00",
          "off-mis": "#56b4e9", "off-shapes": "#666666", "off-vllm": "#de77ae", "on-vllm": "#7fbf7b"}
LABELS = {"on": "on (bitwise)", "off": "off (engine kernels, old = sampler)", "off-recompute": "off-recompute",
          "off-tis": "off-tis (truncated IS)", "off-mis": "off-mis (masked IS)",
          "off-shapes": "off-shapes (same kernels, other shapes)", "off-vllm": "off-vllm", "on-vllm": "on-vllm"}
# Noise arms run light to dark with sigma; purple is used by no named arm.
NOISE_COLORMAP, NOISE_SHADES = "Purples", (0.45, 0.95)
_SPARE = ("#000000", "#d55e00", "#999999", "#a6761d", "#e6ab02")  # arms this module does not know
# Per-step bands resample seeds this often: enough for a smooth 95% band, fast for 500 steps x 7 arms.
BAND_RESAMPLES = 2000
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


_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def arm_styles(arms) -> dict[str, dict]:
    """Per arm a line style and a marker besides its colour, so that arms drawn exactly on top of one another (`off`
    on a CPU, where its kernels agree with `on`'s) still show as two: dashes over a solid line, markers at steps
    staggered between the arms, the first arm wide and pale beneath the others."""
    # The first arm (the reference) wide and pale underneath: a thinner dashed arm on top of it leaves it visible.
    return {a: {"ls": _LINESTYLES[i % len(_LINESTYLES)], "marker": _MARKERS[i % len(_MARKERS)],
                "ms": 7 if i == 0 else 4, "lw": 3.2 if i == 0 else 1.4, "alpha": 0.55 if i == 0 else 1.0,
                "rank": i} for i, a in enumerate(arms)}


def _plot_arm(ax, x, y, color, style: dict, label: str, count: int) -> None:
    """One arm's line in its style: a marker every few points, arm `rank` of `count` starting one point later."""
    every = max(1, len(x) // 12)
    start = (style["rank"] * max(1, every // max(count, 1))) % every
    ax.plot(x, y, color=color, ls=style["ls"], marker=style["marker"], ms=style["ms"], markevery=(start, every),
            mfc="white" if style["rank"] % 2 else color, label=label, lw=style["lw"], alpha=style["alpha"])


def identical_arms(curves: dict[str, pd.Series]) -> list[tuple[str, str]]:
    """Pairs of arms whose curves are the same numbers at every step (each later arm with the first it equals)."""
    pairs, seen = [], []
    for arm, curve in curves.items():
        twin = next((a for a in seen if curves[a].index.equals(curve.index) and np.array_equal(
            curves[a].to_numpy(), curve.to_numpy(), equal_nan=True)), None)
        if twin is not None:
            pairs.append((arm, twin))
        else:
            seen.append(arm)
    return pairs


def _identical_note(pairs: list[tuple[str, str]]) -> str:
    return "; ".join(f"{arm_label(a)} is identical to {arm_label(b)} at every step (drawn over it)"
                     for a, b in pairs)


def bootstrap_band(wide, level: float = LEVEL, n: int = BAND_RESAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a [steps, seeds] array: the BCa bootstrap interval of the mean over seeds (`scipy.stats.
    bootstrap`), or the percentile one where BCa is undefined (seeds that agree exactly: the band is that value).

    Rows with fewer than 2 finite values get NaN (one seed has no spread to resample). Rows are bootstrapped
    together per pattern of present seeds, so a run cut short leaves the other rows' bands whole.
    """
    wide = np.asarray(wide, dtype=float)
    lo, hi = np.full(len(wide), np.nan), np.full(len(wide), np.nan)
    present = np.isfinite(wide)
    for mask in np.unique(present, axis=0):
        rows = (present == mask).all(axis=1)
        if mask.sum() < 2:
            continue
        values = wide[np.ix_(rows, mask)]
        with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            warnings.simplefilter("ignore")  # BCa's "cannot be calculated" on equal seeds: handled below
            ci = stats.bootstrap((values,), np.mean, axis=1, vectorized=True, n_resamples=n, confidence_level=level,
                                 method="BCa", rng=0).confidence_interval
        rlo, rhi = ci.low, ci.high
        flat = ~(np.isfinite(rlo) & np.isfinite(rhi))
        if flat.any():
            ci = stats.bootstrap((values[flat],), np.mean, axis=1, vectorized=True, n_resamples=n,
                                 confidence_level=level, method="percentile", rng=0).confidence_interval
            rlo[flat], rhi[flat] = ci.low, ci.high
        lo[rows], hi[rows] = rlo, rhi
    return lo, hi


def _panels(count: int) -> tuple[Figure, np.ndarray]:
    """A grid of `count` panels, up to 3 a row; a slot the grid leaves over holds the legend (`_legend`)."""
    cols = min(3, count)
    rows = -(-count // cols)
    fig = Figure(figsize=(4.2 * cols + (1.0 if count == 1 else 0.4), 3.0 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes[count:]:
        ax.set_axis_off()
    return fig, axes[:count]


def _style_steps(ax, title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)


def _legend(fig: Figure, axes, title: str = "") -> None:
    """One legend of every arm drawn in any panel (an arm may miss a metric), and the figure's title: the legend
    inside a single panel or in the grid's first empty slot, else in rows above the panels under the title (a
    legend beside the panels would take a third of the width)."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    spare = [ax for ax in fig.axes if not ax.axison]
    if len(axes) > 1 and not spare and handles:
        # The title as the legend's: a suptitle and a legend both above the panels would overlap.
        fig.legend(handles.values(), handles.keys(), loc="outside upper center", ncols=min(3, len(handles)),
                   fontsize=8, frameon=False, title=title or None, title_fontsize=10)
        return
    if title:
        fig.suptitle(title, fontsize=10)
    if len(axes) == 1:
        axes[0].legend(handles.values(), handles.keys(), fontsize=8)
    elif spare:
        spare[0].legend(handles.values(), handles.keys(), loc="center", fontsize=8, frameon=False)


def _by_step(rows: pd.DataFrame, smooth: int) -> pd.DataFrame:
    """step x seed values of one arm and metric, each seed smoothed by a trailing `smooth`-step average."""
    wide = rows.pivot_table(index="step", columns="seed", values="value").sort_index()
    return wide.rolling(smooth, min_periods=1).mean() if smooth > 1 else wide


def reward_curves(table: pd.DataFrame, metrics=("reward_mean",), smooth: int = 1, title: str = "",
                  note: str = "") -> Figure:
    """One panel per metric: per arm the mean over seeds per step, with a 95% BCa bootstrap band over seeds. With
    one panel, `title` names it (no second title above it)."""
    wanted, metrics = metrics, [m for m in metrics if m in set(table.metric)]
    if not metrics:
        raise ValueError(f"none of the metrics {list(wanted)} is in the table; "
                         f"it has {sorted(set(table.metric))[:12]}")
    colors = arm_colors(table.variant)
    styles = arm_styles(colors)
    fig, axes = _panels(len(metrics))
    same: dict[tuple[str, str], int] = {}
    for ax, metric in zip(axes, metrics):
        arms = dict(tuple(table[table.metric == metric].groupby("variant")))
        curves = {}
        for variant in (a for a in colors if a in arms):
            wide = _by_step(arms[variant], smooth)
            curves[variant] = wide.mean(axis=1)
            _plot_arm(ax, wide.index, curves[variant], colors[variant], styles[variant], arm_label(variant),
                      len(colors))
            if wide.shape[1] > 1:
                lo, hi = bootstrap_band(wide.to_numpy())
                ax.fill_between(wide.index, lo, hi, color=colors[variant], alpha=0.2, lw=0)
        for pair in identical_arms(curves):
            same[pair] = same.get(pair, 0) + 1
        _style_steps(ax, title if len(metrics) == 1 and title else TITLES.get(metric, metric))
        if len(metrics) == 1:
            ax.set_ylabel(TITLES.get(metric, metric))
    _legend(fig, axes, title if len(metrics) > 1 else "")
    smoothing = f" after a trailing {smooth}-step average per seed" if smooth > 1 else ""
    how = f"line: mean over seeds{smoothing}\nband: 95% BCa bootstrap CI of that mean per step (none with one seed)"
    identical = _identical_note([pair for pair, n in same.items() if n == len(metrics)])
    fig.supxlabel("\n".join(filter(None, (how, identical, note))), **NOTE_STYLE)
    return fig


def _with_clip_fraction(table: pd.DataFrame) -> pd.DataFrame:
    """The table plus a `clip_fraction` metric (clip_low + clip_high) where both are logged. A sequence-level loss
    logs them per sequence (`seq_*`): they are drawn in the same panels, whose level the loss in the title names."""
    table = table.replace({"metric": {f"seq_{m}": m for m in ("ratio_mean", "clip_low", "clip_high")}})
    clips = table[table.metric.isin(["clip_low", "clip_high"])]
    if set(clips.metric) != {"clip_low", "clip_high"}:
        return table
    wide = clips.pivot_table(index=["variant", "seed", "step"], columns="metric", values="value")
    total = (wide.clip_low + wide.clip_high).dropna().rename("value").reset_index()
    return pd.concat([table, total.assign(metric="clip_fraction")], ignore_index=True)


def _log_panel_arm(ax, wide: pd.DataFrame, variant: str, color: str, notes: list[str], style: dict,
                   count: int) -> bool:
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
    _plot_arm(ax, wide.index, mean.where(mean > 0), color, style, arm_label(variant), count)
    ax.fill_between(wide.index, positive.min(axis=1), positive.max(axis=1), color=color, alpha=0.2, lw=0)
    return True


def _plain_linear_axis(ax) -> None:
    """No offset label ("1e-5+9.9999e-1" above a panel runs into its title): a range narrower than 1e-3 of the
    values is widened to that, so the ticks read as plain numbers (an ESS of 1 - 6e-11 reads as 1.000)."""
    ax.yaxis.set_major_formatter(ScalarFormatter(useOffset=False))
    lo, hi = ax.get_ylim()
    span, scale = hi - lo, max(abs(lo), abs(hi))
    if scale > 0 and span < 1e-3 * scale:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - 5e-4 * scale, mid + 5e-4 * scale)


def mismatch_panels(table: pd.DataFrame, smooth: int = 1, title: str = "") -> Figure:
    """Sampler-trainer mismatch and update health per step, one panel per logged metric: per arm the mean over
    seeds with a min..max band. Mismatch sizes are on log axes, where an arm at exactly 0 (`on`) is a note.
    `title` (e.g. naming the preset) goes above the panels."""
    table = _with_clip_fraction(table)
    panels = [p for p in MISMATCH_PANELS if p[0] in set(table.metric)]
    if not panels:
        raise ValueError(f"no mismatch metric ({[p[0] for p in MISMATCH_PANELS]}) is in the table")
    colors = arm_colors(table.variant)
    styles = arm_styles(colors)
    fig, axes = _panels(len(panels))
    for ax, (metric, name, log) in zip(axes, panels):
        arms = dict(tuple(table[table.metric == metric].groupby("variant")))
        notes, drawn, curves = [], False, {}
        for variant in (a for a in colors if a in arms):
            wide = _by_step(arms[variant], smooth)
            curves[variant] = wide.mean(axis=1)
            if log:
                drawn |= _log_panel_arm(ax, wide, variant, colors[variant], notes, styles[variant], len(colors))
            else:
                _plot_arm(ax, wide.index, curves[variant], colors[variant], styles[variant], arm_label(variant),
                          len(colors))
                if wide.shape[1] > 1:
                    ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=colors[variant],
                                    alpha=0.2, lw=0)
        if log and drawn:  # a log axis with nothing positive on it has no range to show
            ax.set_yscale("log")
        elif log:  # nothing drawn: the notes say why; the steps stay the other panels'
            ax.set_xlim(table.step.min(), table.step.max())
            ax.set_yticks([])
        else:
            _plain_linear_axis(ax)
            if metric == "parity_tokens_differing":  # a count: whole-number ticks, so at least 0 to 1
                lo, hi = ax.get_ylim()
                ax.set_ylim(min(lo, -0.05), max(hi, 1))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        notes += [f"{arm_label(a)} = {arm_label(b)} at every step" for a, b in identical_arms(curves)
                  if not (log and (curves[a] == 0).all())]
        if notes:  # a legend of its own, where matplotlib finds the fewest points: not over a line
            box = ax.legend(handles=[Line2D([], [], ls="none", label=n) for n in notes], loc="best", handlelength=0,
                            handletextpad=0, fontsize=NOTE_STYLE["fontsize"], labelcolor=NOTE_STYLE["color"],
                            framealpha=0.85, borderpad=0.3)
            ax.add_artist(box)  # kept when a one-panel figure adds the arms' legend
        _style_steps(ax, name)
    _legend(fig, axes, title)
    fig.supxlabel("line: mean over seeds; band: min..max over seeds", **NOTE_STYLE)
    return fig


def delta_histogram(deltas: dict[str, np.ndarray], title: str = "") -> Figure:
    """Per-token |Δ log-prob| (sampler - trainer) per named series, on log-spaced bins shared by all series.

    Exact zeros (bitwise-equal tokens) have no place on a log axis, so they are counted in the legend (below the
    axes, clear of the bars); a series with nothing but zeros gets a legend line instead of bars.
    """
    if not deltas:
        raise ValueError("no series to draw")
    series = {name: np.abs(np.asarray(d, dtype=float).ravel()) for name, d in deltas.items()}
    series = {name: d[np.isfinite(d)] for name, d in series.items()}
    nonzero = np.concatenate([d[d > 0] for d in series.values()])
    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
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
    for note in notes:  # legend entries without a mark
        ax.plot([], [], " ", label=note)
    ax.set_xlabel("|log-prob(sampler) - log-prob(trainer)| per token")
    ax.set_ylabel("tokens")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
    fig.legend(loc="outside lower center", fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    return fig

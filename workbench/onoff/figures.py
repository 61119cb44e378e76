"""Figures of an ON/OFF experiment, drawn only from its long metrics table (or from per-token deltas).

Each function returns a matplotlib `Figure` (no pyplot global state), in the look of `workbench.plots`; write
it with `workbench.plots.save_figure`. Per-step bands are BCa bootstrap intervals over seeds (`scipy.stats.
bootstrap`), a display of spread; the calibrated comparison is `paired.compare_paired`'s, shown by
`dose_response_figure` and `regime_map` as t-intervals.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter, FixedLocator, LogLocator, MaxNLocator, NullLocator, ScalarFormatter
from scipy import stats

from ..plots import TITLES
from .paired import ALPHA, LEVEL, t_interval
from .stats import NOISE_PREFIX, REFERENCE, arm_order, dose_slope, noise_sigma

# Okabe-Ito and PiYG/PRGn shades (colorblind-friendly); a vLLM arm is a lighter shade of the arm it mirrors.
COLORS = {"on": "#1b7837", "off": "#c51b7d", "off-recompute": "#0072b2", "off-tis": "#e69f00",
          "off-mis": "#56b4e9", "off-shapes": "#666666", "off-vllm": "#de77ae", "on-vllm": "#7fbf7b"}
LABELS = {"on": "on (bitwise)", "off": "off (engine kernels, old = sampler)", "off-recompute": "off-recompute",
          "off-tis": "off-tis (truncated IS)", "off-mis": "off-mis (masked IS)",
          "off-shapes": "off-shapes (same kernels, other shapes)", "off-vllm": "off-vllm", "on-vllm": "on-vllm"}
# Noise arms run light to dark with sigma; purple is used by no named arm.
NOISE_COLORMAP, NOISE_SHADES = "Purples", (0.45, 0.95)
_SPARE = ("#000000", "#d55e00", "#999999", "#a6761d", "#e6ab02")  # arms this module does not know
_SERIES = ("#c51b7d", "#0072b2", "#e69f00", "#009e73", "#56b4e9", "#d55e00")  # the regime map's (arm, loss) lines
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
    fig, axes = _panels(len(metrics))
    for ax, metric in zip(axes, metrics):
        arms = dict(tuple(table[table.metric == metric].groupby("variant")))
        for variant in (a for a in colors if a in arms):
            wide = _by_step(arms[variant], smooth)
            ax.plot(wide.index, wide.mean(axis=1), color=colors[variant], label=arm_label(variant), lw=1.4)
            if wide.shape[1] > 1:
                lo, hi = bootstrap_band(wide.to_numpy())
                ax.fill_between(wide.index, lo, hi, color=colors[variant], alpha=0.2, lw=0)
        _style_steps(ax, title if len(metrics) == 1 and title else TITLES.get(metric, metric))
        if len(metrics) == 1:
            ax.set_ylabel(TITLES.get(metric, metric))
    _legend(fig, axes, title if len(metrics) > 1 else "")
    smoothing = f" after a trailing {smooth}-step average per seed" if smooth > 1 else ""
    how = f"line: mean over seeds{smoothing}\nband: 95% BCa bootstrap CI of that mean per step (none with one seed)"
    fig.supxlabel(f"{how}\n{note}" if note else how, **NOTE_STYLE)
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
    fig, axes = _panels(len(panels))
    for ax, (metric, name, log) in zip(axes, panels):
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
        elif log:  # nothing drawn: the notes say why; the steps stay the other panels'
            ax.set_xlim(table.step.min(), table.step.max())
            ax.set_yticks([])
        else:
            _plain_linear_axis(ax)
            if metric == "parity_tokens_differing":  # a count: whole-number ticks, so at least 0 to 1
                lo, hi = ax.get_ylim()
                ax.set_ylim(min(lo, -0.05), max(hi, 1))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if notes:  # inside the axes on a white box: clear of the tick labels, readable over a line
            ax.text(0.02, 0.03, "\n".join(notes), transform=ax.transAxes, va="bottom",
                    bbox={"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1.5}, **NOTE_STYLE)
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


def _zero_axis(ax, zero_at: float, smallest: float, largest: float) -> None:
    """Log x ticks with KL 0 drawn at `zero_at`, left of a dotted break before the smallest positive KL.

    At most about six labels, none closer to "0 (on)" than a tenth of the axis: decades (every second one past six
    decades), 1-2-5 steps only within a decade or two.
    """
    cut = np.sqrt(zero_at * smallest)
    ax.axvline(cut, color="0.6", lw=0.8, ls=":")
    left, right = zero_at / 1.6, largest * 1.6
    ax.set_xlim(left, right)
    decades = np.log10(largest / smallest)
    subs = (1.0, 2.0, 5.0) if decades < 1 else (1.0,)
    ticks = [t for t in LogLocator(subs=subs).tick_values(smallest, right) if cut < t <= right]
    if len(ticks) > 6:
        ticks = ticks[len(ticks) % 2::2]
    gap = 0.1 * np.log10(right / left)
    ticks = [t for t in ticks if np.log10(t / zero_at) >= gap]
    ax.xaxis.set_major_locator(FixedLocator([zero_at, *ticks]))
    ax.xaxis.set_major_formatter(FixedFormatter(["0 (on)", *(f"{t:.0e}".replace("e-0", "e-") for t in ticks)]))
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

    window = dose.attrs.get("window")
    ylabels = {"final_reward": f"final reward (last {window} steps)" if window else "final reward",
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

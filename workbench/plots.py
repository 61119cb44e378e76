"""Figures drawn only from the long tables the runs write, never from notebook state.

Each function takes a table and returns a matplotlib `Figure` (no pyplot global state);
`save_figure` writes it as SVG (for a blog post) and PNG (a quick look).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

# ON = invariant (generator = trainer bitwise), OFF = standard (the usual mismatched kernels).
COLORS = {"invariant": "#1b7837", "standard": "#c51b7d"}
LABELS = {"invariant": "invariant (ON)", "standard": "standard (OFF)"}
TITLES = {"reward_mean": "reward", "accuracy": "accuracy", "entropy": "entropy (nats)",
          "sampler_trainer_kl": "KL(sampler || trainer)", "parity_tokens_differing": "tokens differing",
          "parity_max_abs_diff": "max |Δ log-prob|", "kl": "KL penalty (kl_to)"}


def save_figure(fig: Figure, folder: str | Path, name: str) -> list[Path]:
    """Write `name`.svg and `name`.png into folder; returns the two paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{name}.svg", folder / f"{name}.png"]
    fig.savefig(paths[0], bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight", dpi=150)
    return paths


def audit_heatmap(table: pd.DataFrame) -> Figure:
    """Ops x (mode, batch size): the largest ulp distance of a row in a batch vs the row alone (0 = bitwise)."""
    # An op whose batches stop short of an M (attention rows are whole sequences) leaves that cell blank.
    grid = table.pivot_table(index="op", columns=["mode", "rows"], values="max_ulp", aggfunc="max")
    values = grid.to_numpy(dtype=float)
    fig = Figure(figsize=(1.0 + 0.7 * grid.shape[1], 0.8 + 0.45 * grid.shape[0]), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(values, cmap="Reds", vmin=0, vmax=max(1.0, float(np.nanmax(values))), aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [f"{m}\nM={r}" for m, r in grid.columns], fontsize=8)
    ax.set_yticks(range(grid.shape[0]), grid.index, fontsize=9)
    for i, j in zip(*np.nonzero(~np.isnan(values))):
        ax.text(j, i, f"{int(values[i, j])}", ha="center", va="center", fontsize=8)
    for i, j in zip(*np.nonzero(np.isnan(values))):
        ax.text(j, i, "n/a", ha="center", va="center", fontsize=7, color="0.5")
    fig.colorbar(image, ax=ax, label="max ulp distance to the row alone")
    ax.set_title("batch invariance per op (0 everywhere = bitwise)", fontsize=10)
    if np.isnan(values).any():
        fig.supxlabel("n/a: not measured at that batch size (an attention row is a whole sequence, so its batches "
                      "stop at fewer rows)", fontsize=7, color="0.35")
    return fig


def logprob_diff_histogram(tables: dict[str, pd.DataFrame], a: str = "decode", b: str = "train") -> Figure:
    """Histogram of per-token log-prob differences (generator path a minus trainer path b), one series
    per mode; exact zeros are counted apart (they are the bitwise-equal tokens)."""
    fig = Figure(figsize=(6.5, 3.2), layout="constrained")
    ax = fig.subplots()
    for variant, t in tables.items():
        diff = (t[a] - t[b]).to_numpy()
        zeros = int((diff == 0).sum())
        nonzero = diff[diff != 0]
        label = f"{LABELS.get(variant, variant)}: {zeros}/{len(diff)} tokens exactly equal"
        if len(nonzero):
            ax.hist(nonzero, bins=40, alpha=0.6, color=COLORS.get(variant), label=label)
        else:
            ax.axvline(0, color=COLORS.get(variant), lw=2, label=label)
    if all(((t[a] - t[b]) == 0).all() for t in tables.values()):
        ax.text(0.5, 0.5, "every token's log-prob is exactly equal in every mode:\nno difference to histogram "
                "(on a CPU the standard kernels match here too)", transform=ax.transAxes, ha="center",
                va="center", fontsize=8, color="0.35")
    ax.set_xlabel(f"log-prob({a}) - log-prob({b})")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig

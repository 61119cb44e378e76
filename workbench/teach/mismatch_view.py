"""The token-level mismatch viewer: where, in one sequence, the sampler's and the trainer's log-probs part.

Drawn only from the long table of `token_table` (one row per token: sampler_logprob, trainer_logprob), so a
published GPU record and a live CPU run are viewed alike:
- the tokens, coloured by |Δ log-prob| (sampler - trainer), the first one whose bits differ outlined;
- the cumulative log-ratio Σ (trainer - sampler) against position: independent per-token differences add up as a
  random walk, whose spread grows as sqrt(t); a systematic one as a bias, growing as t; `invariant` is identically 0;
- the KL per token (the k3 estimate r - 1 - log r, r = trainer / sampler probability of the sampled token, as the RL
  metrics log it);
- the sequence's ratio exp(Σ) against the loss's clip range, and the op of the first divergence from the parity
  report where one is given.

`python -m workbench.teach.mismatch_view --device cuda --policy smollm2-135m-instruct --out DIR` writes a record
(`token_table.TABLE_FILE`, the first-divergence table, env.json) for docs/results.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib import colormaps
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .. import records
from ..env import environment_record, resolve_device
from ..generation import SamplingParams, random_prompts
from ..models import build, encode_prompt, load_pretrained, load_tokenizer, resolve_model

from .token_table import ARMS, DIVERGENCE_FILE, GPU_ARMS, TABLE_FILE, divergence_table, record_name, token_table

CLIP = 0.2
"""The PPO clip range of the default losses (GRPO, the blog's): a ratio outside [1 - 0.2, 1 + 0.2] is clipped."""
_PER_ROW = 16  # tokens per row of the token strip


def sequence(table: pd.DataFrame, arm: str, seq: int, run: str | None = None) -> pd.DataFrame:
    """One sequence's tokens in order, with delta (sampler - trainer), log_ratio (trainer - sampler), its running
    sum `cumulative`, `kl` (k3) and `differs` (the two fp32 values are not the same number). `run` is a
    "<source> · <model>" label of `runs` (None: the table's first)."""
    rows = table[(table.arm == arm) & (table.seq == seq)]
    if run is not None:
        rows = rows[_run_labels(rows) == run]
    elif len(rows):
        rows = rows[_run_labels(rows) == _run_labels(rows).iloc[0]]
    rows = rows.sort_values("pos").reset_index(drop=True)
    delta = rows.sampler_logprob.to_numpy(float) - rows.trainer_logprob.to_numpy(float)
    log_ratio = -delta
    # k3 >= 0; expm1(x) - x rounds to a few 1e-19 below 0 for |x| near 1e-7.
    return rows.assign(delta=delta, log_ratio=log_ratio, cumulative=np.cumsum(log_ratio),
                       kl=np.maximum(np.expm1(log_ratio) - log_ratio, 0.0), differs=delta != 0)


def _run_labels(table: pd.DataFrame) -> pd.Series:
    return table.source.astype(str) + " · " + table.model.astype(str)


def runs(table: pd.DataFrame) -> list[str]:
    """The "<source> · <model>" runs in the table, in order of appearance."""
    return list(dict.fromkeys(_run_labels(table)))


@dataclass(frozen=True)
class Reading:
    """What one sequence's numbers say, in words."""

    first: str
    """The first token whose log-probs differ, or that none does."""
    ratio: str
    """The sequence's ratio exp(Σ log-ratio) against the clip range."""
    op: str
    """The parity report's first divergence for the arm, where known."""


def reading(rows: pd.DataFrame, arm: str, clip: float = CLIP, divergence: pd.DataFrame | None = None) -> Reading:
    """The first differing token, the sequence ratio against [1 - clip, 1 + clip], the op of the first divergence
    (`divergence`: arm, first_divergence; with a `source` column, the rows of this sequence's source)."""
    hits = rows.index[rows.differs]
    first = (f"first differing token: position {rows.pos[hits[0]]} ({rows.text[hits[0]]!r}), |Δ log-prob| "
             f"{abs(rows.delta[hits[0]]):.3g}; {len(hits)} of {len(rows)} tokens differ" if len(hits)
             else f"every one of the {len(rows)} tokens has the same log-prob bits on both sides")
    total = float(rows.cumulative.iloc[-1]) if len(rows) else 0.0
    ratio = math.exp(total)
    inside = 1 - clip <= ratio <= 1 + clip
    ratio_text = (f"Σ log-ratio {total:.3g}, sequence ratio exp(Σ) = {ratio:.8g}: "
                  f"{'inside' if inside else 'OUTSIDE'} the loss's clip "
                  f"range [{1 - clip:g}, {1 + clip:g}]" + ("" if inside else ", clipped before any update"))
    op = "first divergence (parity report): not in the report for this arm"
    if divergence is not None and "source" in divergence and len(rows):  # a report per run: this run's
        divergence = divergence[divergence.source == rows.source.iloc[0]]
    if divergence is not None and arm in set(divergence.arm):
        op = f"first divergence (parity report): {divergence.set_index('arm').first_divergence[arm]}"
    return Reading(first, ratio_text, op)


def _token_strip(ax, rows: pd.DataFrame, norm, cmap) -> None:
    """The tokens as boxes, _PER_ROW a line, coloured by |Δ| (white where exactly 0); the first differing outlined."""
    first = rows.index[rows.differs][0] if rows.differs.any() else None
    lines = max(1, -(-len(rows) // _PER_ROW))
    for i, r in rows.iterrows():
        x, y = i % _PER_ROW, lines - 1 - i // _PER_ROW
        size = abs(r.delta)
        color = "white" if size == 0 else cmap(norm(size))
        ax.add_patch(_box(x, y, color, edge="#00a6d6" if i == first else "0.8", lw=2.5 if i == first else 0.5))
        label = str(r.text).replace("\n", "⏎").strip() or "␣"
        ax.text(x + 0.5, y + 0.5, label[:7], ha="center", va="center", fontsize=6,
                color="white" if size and norm(size) > 0.6 else "black")
    ax.set_xlim(0, _PER_ROW)
    ax.set_ylim(0, lines)
    ax.set_axis_off()


def _box(x, y, color, edge, lw):
    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=color, edgecolor=edge, lw=lw)


def mismatch_figure(table: pd.DataFrame, arm: str, seq: int = 0, run: str | None = None, clip: float = CLIP,
                    divergence: pd.DataFrame | None = None) -> Figure:
    """One sequence of one arm: the token strip, the cumulative log-ratio with the sqrt(t) and t references and the
    clip range, the KL per token, and the reading under them. An absent (run, arm, seq) draws a note saying so."""
    rows = sequence(table, arm, seq, run)
    run = run or (runs(table)[0] if len(table) else "")
    lines = max(1, -(-len(rows) // _PER_ROW))
    fig = Figure(figsize=(10, 3.4 + 0.32 * lines), layout="constrained")
    strip, panels = fig.subfigures(2, 1, height_ratios=[0.32 * lines + 0.5, 3.0])
    top, bottom = strip.subplots(), panels.subplots(1, 2)
    fig.suptitle(f"{run} · {arm} · sequence {seq}", fontsize=10)
    if rows.empty:
        top.set_axis_off()
        for ax in bottom:
            ax.set_axis_off()
        top.text(0.5, 0.5, f"no sequence {seq} of arm {arm!r} in {run!r}", ha="center", va="center")
        return fig
    sizes = rows.delta.abs()
    positive = sizes[sizes > 0]
    norm = LogNorm(positive.min(), max(positive.max(), positive.min() * 10)) if len(positive) else LogNorm(1e-8, 1)
    cmap = colormaps["magma_r"]
    _token_strip(top, rows, norm, cmap)
    scale = (f"; log colour scale, pale {positive.min():.2g} to dark {positive.max():.2g}" if len(positive) > 1
             and positive.min() < positive.max() else "")
    top.set_title("tokens coloured by |log-prob(sampler) - log-prob(trainer)| (white: the same bits; outlined in "
                  f"blue: the first that differs{scale})", fontsize=8)
    left, right = bottom
    t = rows.pos.to_numpy() + 1
    left.plot(t, rows.cumulative, color="#c51b7d", lw=1.6, marker="o", ms=2.5, gid="cumulative",
              label="Σ log-ratio (trainer - sampler)")
    step = rows.log_ratio.to_numpy()
    if step.any():  # the two growth laws, scaled by this sequence's own per-token differences
        left.plot(t, step.std() * np.sqrt(t), color="0.45", ls=":", lw=1, label="random walk: ± sd · sqrt(t)")
        left.plot(t, -step.std() * np.sqrt(t), color="0.45", ls=":", lw=1)
        left.plot(t, step.mean() * t, color="0.45", ls="--", lw=1, label="bias: mean · t")
    bounds = (math.log(1 + clip), math.log(1 - clip))
    reach = float(np.abs(rows.cumulative).max())
    if reach == 0 or reach > 0.05 * bounds[0]:  # drawn where they do not flatten the walk to a line at 0
        for bound in bounds:
            left.axhline(bound, color="#1b7837", lw=0.8, ls="-.")
        left.plot([], [], color="#1b7837", lw=0.8, ls="-.", label=f"clip: log(1 ± {clip:g})")
    else:
        left.plot([], [], " ", label=f"clip log(1 ± {clip:g}) = {bounds[0]:+.2f} / {bounds[1]:+.2f}: far off this "
                  "axis")
    if not step.any():
        left.text(0.5, 0.6, "identically 0: the sampler's and the trainer's log-probs are the same bits",
                  transform=left.transAxes, ha="center", fontsize=8, color="0.3",
                  bbox={"facecolor": "white", "alpha": 0.85, "lw": 0})
    left.set(xlabel="position t (generated tokens)", ylabel="cumulative log-ratio")
    left.legend(fontsize=7, loc="best", framealpha=0.85)
    right.plot(t, rows.kl, color="#0072b2", lw=1.2, marker="o", ms=2.5, gid="kl")
    right.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    right.set(xlabel="position t", ylabel="KL per token (k3)", title=f"mean KL per token {rows.kl.mean():.3g}")
    left.set_title("cumulative log-ratio: a random walk grows as sqrt(t), a bias as t", fontsize=9)
    right.title.set_fontsize(9)
    for ax in bottom:
        ax.grid(alpha=0.3)
    words = reading(rows, arm, clip, divergence)
    fig.supxlabel(f"{words.first}\n{words.ratio}\n{words.op}", fontsize=8, color="0.25")
    return fig


def mismatch_viewer(table: pd.DataFrame, divergence: pd.DataFrame | None = None, clip: float = CLIP):
    """Choose a run (source and model), an arm and a sequence; see `mismatch_figure` (ipywidgets). Without
    ipywidgets, the figure of the first run, arm and sequence. The widget's `result` is the figure shown."""
    first = runs(table)[0]
    arms = [a for a in ARMS if a in set(table.arm)] + [a for a in dict.fromkeys(table.arm) if a not in ARMS]
    seqs = sorted(set(table.seq))
    try:
        import ipywidgets
        from IPython.display import display
    except ImportError:
        return mismatch_figure(table, arms[0], seqs[0], first, clip, divergence)

    def show(run, arm, seq):
        fig = mismatch_figure(table, arm, seq, run, clip, divergence)
        display(fig)
        return fig

    return ipywidgets.interactive(
        show, run=ipywidgets.Dropdown(options=runs(table), value=first, description="run"),
        arm=ipywidgets.Dropdown(options=arms, value=arms[0], description="arm"),
        seq=ipywidgets.Dropdown(options=seqs, value=seqs[0], description="sequence"))


@dataclass(frozen=True)
class RecordConfig:
    policy: str = ""
    """A real model (registry name such as smollm2-135m-instruct, a folder, a hub id); empty: the tiny random model."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto'."""
    arms: tuple[str, ...] = ()
    """Arms of `token_table.ARMS`; empty: every arm on a CPU, GPU_ARMS on a GPU."""
    prompts: int = 16
    """Sequences per arm."""
    tokens: int = 256
    """New tokens per sequence (fewer where the model stops)."""
    seed: int = 0
    """Sampling seed."""
    out: str = "runs/token_mismatch"
    """The record's folder."""

    def __post_init__(self):
        if self.prompts < 1 or self.tokens < 1:
            raise ValueError(f"prompts and tokens must be >= 1, got {self.prompts} and {self.tokens}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")


def live_run(cfg: RecordConfig, progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The long table and the first-divergence table of cfg's model on this machine (source 'live, <device>')."""
    device = resolve_device(cfg.device)
    arms = cfg.arms or (GPU_ARMS if device == "cuda" else tuple(ARMS))
    stop: tuple[int, ...] = ()
    if cfg.policy:
        folder = resolve_model(cfg.policy)
        model, tok = load_pretrained(folder, device=device), load_tokenizer(folder)
        prompts = [encode_prompt(tok, f"What is {3 * i + 7} times {i + 2}? Explain step by step.")
                   for i in range(cfg.prompts)]
        stop, name = (tok.eos_token_id,), Path(str(folder)).name

        def text(t):
            return tok.decode([t])
    else:
        model = build("tiny", device=device, dtype=torch.bfloat16, seed=cfg.seed)
        prompts = random_prompts(cfg.prompts, model.config.vocab_size, max_len=8, seed=cfg.seed + 1)
        name = "tiny (random weights)"

        def text(t):
            return f"#{t}"
    params = SamplingParams(temperature=1.0, max_new_tokens=cfg.tokens, seed=cfg.seed, stop_token_ids=stop)
    source = f"live, {'GPU, ' + torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}"
    table = token_table(model, prompts, arms, params, name, source, text, progress)
    return table, divergence_table(model, arms).assign(source=source)


def write_record(cfg: RecordConfig) -> Path:
    """cfg.out/<date>_token-mismatch-<device>_<sha>/ with the long table (gzip CSV), the first-divergence table and
    env.json: a folder to copy into docs/results as is."""
    table, divergence = live_run(cfg)
    env = environment_record()
    folder = Path(cfg.out) / record_name(env)
    folder.mkdir(parents=True, exist_ok=True)
    table.drop(columns="source").to_csv(folder / TABLE_FILE, index=False)
    divergence.drop(columns="source").to_csv(folder / DIVERGENCE_FILE, index=False)
    (folder / "env.json").write_text(json.dumps({**env, "config": vars(cfg)}, indent=1, default=str))
    records.write_record(folder, records.Record(
        folder.name, "parity", "Token by token: where sampler and trainer disagree, per arm", {},
        env.get("gpu") or "CPU", env.get("git_sha", "nogit"), folder.name[:10],
        "python -m workbench.teach.mismatch_view " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                            vars(cfg).items() if v not in ((), "")),
        "(to be written: the table and its reading)"))
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workbench.teach.mismatch_view",
                                description="Write a token-level mismatch record (sampler vs trainer log-probs).")
    for name, f in RecordConfig.__dataclass_fields__.items():
        flag = f"--{name.replace('_', '-')}"
        if name == "arms":
            p.add_argument(flag, nargs="*", default=(), help=f"any of {list(ARMS)}")
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    args = vars(p.parse_args(argv))
    try:
        cfg = RecordConfig(**{**args, "arms": tuple(args["arms"])})
        folder = write_record(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"mismatch_view: {e}", file=sys.stderr)
        return 2
    size = (folder / TABLE_FILE).stat().st_size
    print(f"wrote {folder} ({TABLE_FILE}: {size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

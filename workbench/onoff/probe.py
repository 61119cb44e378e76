"""What an arm's mismatch is before any training: its first steps' sampler-trainer statistics.

Every run of an experiment samples its first step with the starting policy on the prompts of its seed, so the first
steps of two arms with one seed compare their kernels on the same weights and prompts. `probe` runs each arm of an
ON/OFF config for a few steps (at one or more generation lengths), and `probe_table` reads what they measured; a
probe costs a few steps a run, where a run costs hundreds. It is how an OFF arm is shown to mismatch as the engine
it models does (`bench/probe_mismatch.py` sets the embedded arms beside `off-vllm`), and how the regime map's
mismatch grows with the length before its reward is known.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from ..records import load_index
from ..tables import project_path
from .config import OnOffConfig
from .runner import run_on_off

PROBE_METRICS = ("sampler_trainer_kl", "parity_mean_abs_diff", "parity_max_abs_diff", "parity_tokens_differing",
                 "seq_logratio_sd", "seq_ratio_outside_1.2", "is_ess", "reward_mean", "response_length",
                 "time_step")
"""The metrics a probe reports: the mismatch (per token and per sequence), and the start reward, length and speed."""


def probe(cfg: OnOffConfig, steps: int = 1, lengths: tuple[int, ...] = ()) -> pd.DataFrame:
    """Run cfg's arms x seeds for `steps` steps at each of `lengths` (max_new_tokens; empty: cfg's own), each length
    into cfg.out_dir/L<length>; returns `probe_table` of them all. Finished probes are not run again."""
    tables = []
    for length in lengths or (cfg.run.rollout.max_new_tokens,):
        cell = dataclasses.replace(cfg, steps=steps, max_new_tokens=length, out_dir=f"{cfg.out_dir}/L{length}",
                                   keep_checkpoints=False, checkpoint_every=steps)
        tables.append(probe_table(run_on_off(cell), cell))
    return pd.concat(tables, ignore_index=True)


def probe_table(metrics: pd.DataFrame, cfg: OnOffConfig) -> pd.DataFrame:
    """One row per (arm, seed): the mean over the probed steps of each of PROBE_METRICS, with the cell's settings."""
    rows = metrics[metrics.metric.isin(PROBE_METRICS) & (metrics.step <= cfg.run.steps)]
    wide = rows.pivot_table(index=["variant", "seed"], columns="metric", values="value", aggfunc="mean")
    wide = wide.reset_index().rename(columns={"variant": "arm"})
    for name, value in (("preset", cfg.preset), ("task", cfg.run.data.task), ("loss", cfg.run.objective.loss),
                        ("max_new_tokens", cfg.run.rollout.max_new_tokens), ("steps", cfg.run.steps)):
        wide.insert(0, name, value)
    return wide


def published_metrics(root: str | Path, preset: str, arm: str) -> pd.DataFrame:
    """The long metrics table of `arm` in the newest published ON/OFF record of `preset` (or a variant of it,
    `<preset>-...`) in root's index (docs/results; a relative root is the project's) that ran it; an empty table
    where none did."""
    records = [r for r in load_index(root) if r.kind == "onoff" and (r.preset == preset or
                                                                     r.preset.startswith(f"{preset}-"))]
    for record in sorted(records, key=lambda r: (r.date, r.folder), reverse=True):
        path = project_path(root) / record.folder / "metrics.csv.gz"
        if path.exists():
            table = pd.read_csv(path)
            if (table.variant == arm).any():
                return table[table.variant == arm].assign(source=record.folder)
    return pd.DataFrame(columns=["step", "metric", "value", "variant", "seed", "source"])

"""`sweep`: every point of a grid, run as one experiment (train, on-off) into its own folder of out_root.

A point that finished (its marker) is skipped; one cut short (a kill, a time limit, a failure) goes on where its
experiment can: `train` from the checkpoints in its folder, `on-off` from its runs'. A failing point does not
stop the others; the first failure is raised at the end, after the tables are written.

out_root gets:
- `<point>/` (e.g. `lr=1e-05,seed=0`): the experiment's own folder (its config.yaml, metrics.csv, checkpoints),
  and `finished.json` once it ran to the end;
- `metrics.csv`: the long tables of the grid's points (finished or not) in one, with `point` and the swept
  fields as columns;
- `points.csv`: each point's fields, whether it finished, what this call did with it, and its final metric;
- `sweep_<metric>.svg|png`: the comparison figure; `config.yaml`: this call's settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..config import flat_dict, write_config
from ..onoff.config import OnOffConfig, preset_base
from ..onoff.runner import RunFailed, run_on_off
from ..rl.checkpoint import latest_checkpoint
from ..rl.config import TrainConfig
from ..rl.trainer import train
from ..rundir import claim, start_over
from .grid import FINISHED, finished, format_value, mark_finished, parse_grid, point_names, points, swept, write_atomic


def _no_base(values: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Experiment:
    """What a sweep runs at each point."""

    config: type
    """The experiment's config dataclass; its out_dir field becomes the point's folder."""
    run: Callable[[Any], bool]
    """Runs or continues the point (writing its long table to out_dir/metrics.csv); True once it ran to the end."""
    base: Callable[[dict], dict] = _no_base
    """The values a point's settings start from, given the grid's values for it (on-off: the preset they name)."""


def _train(cfg: TrainConfig) -> bool:
    # A point cut short left checkpoints in its folder: the trainer goes on from the newest; without one it starts over.
    resume = latest_checkpoint(Path(cfg.out_dir)) is not None
    if not resume:
        start_over(cfg.out_dir)
    table = train(dataclasses.replace(cfg, resume=resume))
    return int(table.step.max()) >= cfg.steps  # a time_limit_s stops it early, checkpointed


def _on_off(cfg: OnOffConfig) -> bool:
    run_on_off(cfg)  # resumes its own runs, and says in runs.csv which finished
    return bool(pd.read_csv(Path(cfg.out_dir) / "runs.csv").finished.all())


EXPERIMENTS = {
    "train": Experiment(TrainConfig, _train),
    "on-off": Experiment(OnOffConfig, _on_off, preset_base),
}
"""The experiments a sweep can run, by their command name; another is one line here."""


@dataclass(frozen=True)
class SweepOptions:
    out_root: str = ""
    """One folder per point below this, and the combined metrics.csv and figure; empty:
    runs/sweeps/<experiment>_<swept fields>."""
    metric: str = "reward_mean"
    """The metric the comparison figure draws: each point's curve, and its value at the last step."""


@dataclass(frozen=True)
class SweepConfig(SweepOptions):
    """A sweep: the options, and the experiment and grid (positional on the command line)."""

    experiment: str = "train"
    """The experiment each point runs: a command of `python -m workbench` (train, on-off)."""
    grid: tuple[str, ...] = ()
    """One item per axis, field=v1,v2,... (every combination runs once); field=v sets a field for every point."""

    def __post_init__(self):
        if self.experiment not in EXPERIMENTS:
            raise ValueError(f"unknown experiment {self.experiment!r}; a sweep runs one of {', '.join(EXPERIMENTS)}")
        parse_grid(self.grid, EXPERIMENTS[self.experiment].config, "out_dir")


def sweep_folder(cfg: SweepConfig) -> Path:
    """Where the sweep's points and tables go."""
    fields = swept(parse_grid(cfg.grid, EXPERIMENTS[cfg.experiment].config, "out_dir"))
    return Path(cfg.out_root or f"runs/sweeps/{cfg.experiment}" + ("_" + "-".join(fields) if fields else ""))


def sweep(cfg: SweepConfig) -> pd.DataFrame:
    """Run every point of the grid not finished yet; returns the long table of all of them (also
    out_root/metrics.csv) and draws the comparison figure. out_root is locked meanwhile: a second process is
    refused."""
    with claim(sweep_folder(cfg), "sweep", option="--out-root"):
        return _sweep(cfg)


def _sweep(cfg: SweepConfig) -> pd.DataFrame:
    from ..plots import save_figure, sweep_comparison  # matplotlib: missing, say so before any run

    experiment = EXPERIMENTS[cfg.experiment]
    axes = parse_grid(cfg.grid, experiment.config, "out_dir")
    fields, grid, out = swept(axes), points(axes), sweep_folder(cfg)
    names = point_names(grid, fields)
    runs = {}
    for name, point in zip(names, grid):  # every point's settings checked by its dataclass before anything runs
        try:
            runs[name] = experiment.config(**{**experiment.base(point), **point, "out_dir": str(out / name)})
        except ValueError as e:
            raise ValueError(f"grid point {name}: {e}") from None
    settings = {name: {k: v for k, v in flat_dict(run).items() if k != "out_dir"}
                for name, run in runs.items()}
    # A finished point is skipped; one finished with other settings is an error, before anything runs.
    status = {name: "skipped" for name in runs if finished(out / name / FINISHED, settings[name])}
    write_config(cfg, out / "config.yaml")
    failures: list[tuple[str, Exception]] = []
    try:
        for i, (name, run) in enumerate(runs.items(), 1):
            if name in status:
                continue
            print(f"sweep {cfg.experiment} [{i}/{len(runs)}] {name}", flush=True)
            (out / name).mkdir(exist_ok=True)
            start = time.perf_counter()
            try:
                done = experiment.run(run)
            except Exception as e:  # noqa: BLE001  the others still run; raised at the end
                status[name] = "failed"
                failures.append((name, e))
                continue
            if done:
                mark_finished(out / name / FINISHED, settings[name], seconds=round(time.perf_counter() - start, 1))
            status[name] = "done" if done else "stopped"
    finally:  # an interrupted sweep still leaves its tables
        table = collect(out, dict(zip(names, grid)), fields, status, cfg.metric)
    if (table.metric == cfg.metric).any():
        save_figure(sweep_comparison(table, fields, cfg.metric), out, f"sweep_{cfg.metric}")
    if failures:
        name, error = failures[0]
        raise RunFailed(f"point {name} failed ({len(failures)} of {len(runs)} points failed; the others' metrics "
                        f"are in {out / 'metrics.csv'}; a rerun skips the finished points): {error}") from error
    if len(table) and not (table.metric == cfg.metric).any():
        raise ValueError(f"no metric {cfg.metric!r} in {out / 'metrics.csv'} for the figure; it has "
                         f"{', '.join(sorted(table.metric.unique()))}: rerun with --metric NAME (the points are kept)")
    return table


def collect(out: Path, grid: dict[str, dict], fields: list[str], status: dict[str, str],
            metric: str) -> pd.DataFrame:
    """The long table of the grid's points (finished or not), written atomically to out/metrics.csv, and each
    point's state and final `metric` (the mean of its runs at its last step) to out/points.csv."""
    tables, rows = [], []
    for name, point in grid.items():
        values = {k: format_value(point[k]) if isinstance(point[k], tuple) else point[k] for k in fields}
        path = out / name / "metrics.csv"
        table = pd.read_csv(path).assign(point=name, **values) if path.exists() and path.stat().st_size \
            else pd.DataFrame()
        tables.append(table)
        rows.append({"point": name, **values, "finished": (out / name / FINISHED).exists(),
                     "this_call": status.get(name, "not reached")})
        if len(table):
            last = table[table.metric == metric]
            rows[-1][f"final_{metric}"] = last[last.step == last.step.max()].value.mean()
    table = pd.concat([t for t in tables if len(t)], ignore_index=True) if any(len(t) for t in tables) \
        else pd.DataFrame(columns=["step", "metric", "value", "point", *fields])
    write_atomic(out / "metrics.csv", table.to_csv(index=False))
    write_atomic(out / "points.csv", pd.DataFrame(rows).to_csv(index=False))
    return table

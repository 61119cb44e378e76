"""`publish=` of an ON/OFF experiment: the regime preset's as one arm record per arm, any other as one record.

The regime map's unit is the arm (`regime_record` pairs arms by seed from their records), while a GPU hold may run
several arms together (`on` and a dose, parts of their seeds, under one MPS daemon): each arm is published from a
view of the experiment as if it had run alone."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from ..config import read_config_file, write_config
from .config import OnOffConfig
from .publish import publish
from .runner import POLICY_RECORD, RUN_FOLDER


def publish_experiment(out_dir: str | Path, dest: str | Path) -> list[Path]:
    """What `publish=` does: `publish_arms` for the regime preset's experiments of several arms (the map pairs arms
    from their records), else `publish`; the config is read once here."""
    cfg = OnOffConfig(**read_config_file(Path(out_dir) / "config.yaml", OnOffConfig))
    if cfg.preset != "regime" or len(cfg.arms) == 1:
        return [publish(out_dir, dest)]
    return publish_arms(Path(out_dir), cfg, dest)


def publish_arms(out: Path, cfg: OnOffConfig, dest: str | Path) -> list[Path]:
    """One arm record per arm of the experiment in `out` (its config `cfg`), each published from a view of the
    experiment as if that arm had run alone (out/arms/<arm>/: its config with that arm, links to its run folders,
    the call log and the starting weights' digest). A run's bits do not depend on what else shared its GPU
    (tests/test_gpu_mps.py), so runs of several arms in one hold are the runs each arm would hold alone."""
    runs = {arm: [run for run in sorted(out.iterdir()) if run.is_dir() and (m := RUN_FOLDER.fullmatch(run.name))
                  and m["arm"] == arm and (run / "metrics.csv").exists()] for arm in cfg.arms}
    if missing := [arm for arm, found in runs.items() if not found]:
        raise ValueError(f"{out} holds no run of arm(s) {', '.join(missing)} (no <arm>-seed<n>/metrics.csv): run "
                         "them first (the same on-off command continues the experiment), nothing was published")
    folders = []
    for arm in cfg.arms:
        view = out / "arms" / arm
        if view.exists():
            shutil.rmtree(view)
        view.mkdir(parents=True)
        write_config(replace(cfg, arms=(arm,), out_dir=str(view)), view / "config.yaml")
        for name in ("invocations.csv", POLICY_RECORD):
            if (out / name).exists():
                shutil.copy(out / name, view / name)
        for run in runs[arm]:
            (view / run.name).symlink_to(Path("..", "..", run.name))
        folders.append(publish(view, dest))
    return folders

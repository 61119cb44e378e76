"""Sweeps: the grid syntax checked against the experiment's config, one folder per point, a 2 x 3 sweep of CPU
smoke training runs from one call that resumes after an interruption without redoing finished runs, and the same
grids over notebook parameters in the nightly."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from workbench.__main__ import main
from workbench.nightly import NightlyConfig, run_nightly
from workbench.onoff.config import OnOffConfig
from workbench.onoff.runner import RunFailed
from workbench.rl.config import TrainConfig
from workbench.sweep import runner
from workbench.sweep.grid import parse_grid, point_name, point_names, points, split_values, swept
from workbench.sweep.runner import EXPERIMENTS, Experiment, SweepConfig, sweep

# The smallest CPU run of the trainer: one prompt of two samples (under a second from the shared tiny policy).
SMOKE = ("kernel_mode=standard", "prompts_per_step=1", "group_size=2", "max_new_tokens=2",
         "checkpoint_every=1", "device=cpu", "progress=false")


def test_grid_values_are_typed_and_checked_by_the_config():
    axes = parse_grid(["lr=1e-5,3e-5", "seed=0,1,2", "policy=a,'b,c'", "steps=2", "resume=true"], TrainConfig,
                      "out_dir")
    assert axes == {"lr": [1e-5, 3e-5], "seed": [0, 1, 2], "policy": ["a", "b,c"], "steps": [2], "resume": [True]}
    assert swept(axes) == ["lr", "seed", "policy"]
    grid = points(axes)
    assert len(grid) == 12 and grid[0]["lr"] == grid[5]["lr"] == 1e-5 and [p["seed"] for p in grid[:6:2]] == [0, 1, 2]
    assert parse_grid(["seeds=[0,1],[2]", 'arms=["on","off"]'], OnOffConfig, "out_dir") == {
        "seeds": [(0, 1), (2,)], "arms": [("on", "off")]}
    assert split_values('[0, 1],"x,y",z') == ["[0, 1]", '"x,y"', "z"]


@pytest.mark.parametrize("items, match", [
    (["lrr=1e-5,3e-5"], r"'lrr=1e-5,3e-5'.*unknown setting 'lrr' for TrainConfig; did you mean 'lr'"),
    (["zzz=1"], r"unknown setting 'zzz' for TrainConfig; valid settings: policy, .*, seed,"),
    (["seed=0,x"], "seed must be int, got 'x'"),
    (["steps=1.5"], "steps must be int, got 1.5"),
    (["seed"], "must be field=value"),
    (["out_dir=a,b"], "out_dir is set by the sweep"),
    (["seed=0", "seed=1"], "seed is given twice"),
    (["seed=0,0"], "repeats a value"),
    (["policy="], r"^grid item 'policy=' has no value: give policy=v1,v2,..., or leave the item out$"),
])
def test_bad_grids_name_the_field(items, match):
    with pytest.raises(ValueError, match=match):
        parse_grid(items, TrainConfig, "out_dir")


def test_points_are_named_by_their_swept_fields():
    assert point_name({"seed": 0, "lr": 1e-5, "steps": 2}, ["seed", "lr"]) == "lr=1e-05,seed=0", \
        "alphabetical: reordering the grid's items keeps the folders"
    assert point_name({"policy": "runs/p 1", "chat_template": False}, ["policy", "chat_template"]) == \
        "chat_template=false,policy=runs_p_1"
    assert point_name({"seeds": (0, 1)}, ["seeds"]) == "seeds=0+1" and point_name({"steps": 2}, []) == "single"
    with pytest.raises(ValueError, match="would share the folder 'policy=a_b'"):
        point_names([{"policy": "a/b"}, {"policy": "a b"}], ["policy"])
    with pytest.raises(ValueError, match="grid item 'kernel_mode=standard,fast': kernel_mode must be"):
        SweepConfig(grid=("kernel_mode=standard,fast",), out_root="unused")  # a choice: refused as the grid is read
    with pytest.raises(ValueError, match="grid point generator=vllm: generator='vllm' holds its own copy"):
        sweep(SweepConfig(grid=("generator=embedded,vllm", "sync=shared"), out_root="unused"))
    with pytest.raises(ValueError, match="unknown experiment 'nightly'; a sweep runs one of train, on-off"):
        SweepConfig(experiment="nightly")


def test_a_2x3_train_sweep_resumes_after_an_interruption(policy, tmp_path, monkeypatch):
    from workbench.rl import trainer

    steps, real_step = [], trainer.train_step

    def step(run, n):
        steps.append((Path(run.cfg.out_dir).name, n))
        if len(steps) == 8:  # the 4th point's 2nd step: its step 1 is checkpointed
            raise KeyboardInterrupt
        return real_step(run, n)

    monkeypatch.setattr(trainer, "train_step", step)
    cfg = SweepConfig(grid=("lr=1e-3,3e-3", "seed=0,1,2", "steps=2", f"policy={policy}", *SMOKE),
                      out_root=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        sweep(cfg)
    done = sorted(p.parent.name for p in tmp_path.glob("*/finished.json"))
    assert done == ["lr=0.001,seed=0", "lr=0.001,seed=1", "lr=0.001,seed=2"]
    state = pd.read_csv(tmp_path / "points.csv")
    assert list(state.this_call) == ["done"] * 3 + ["not reached"] * 3, "the tables are written on the way out"
    mtimes = {p: p.stat().st_mtime_ns for p in tmp_path.glob("lr=0.001*/*.*")}

    steps.clear()
    table = sweep(cfg)
    assert steps == [("lr=0.003,seed=0", 2), ("lr=0.003,seed=1", 1), ("lr=0.003,seed=1", 2),
                     ("lr=0.003,seed=2", 1), ("lr=0.003,seed=2", 2)], \
        "the finished points are not redone; the interrupted one goes on from its checkpoint at step 1"
    assert mtimes == {p: p.stat().st_mtime_ns for p in mtimes}, "nothing of a finished point is touched"
    assert {"step", "metric", "value", "point", "lr", "seed"} <= set(table.columns)
    assert table.groupby(["lr", "seed"]).step.max().to_dict() == {(lr, s): 2 for lr in (1e-3, 3e-3) for s in (0, 1, 2)}
    assert pd.read_csv(tmp_path / "metrics.csv").shape == table.shape
    state = pd.read_csv(tmp_path / "points.csv")
    assert list(state.this_call) == ["skipped"] * 3 + ["done"] * 3 and state.finished.all()
    assert state.final_reward_mean.between(0, 1).all()
    for ext in ("svg", "png"):
        assert (tmp_path / f"sweep_reward_mean.{ext}").stat().st_size > 0

    steps.clear()
    sweep(cfg)
    assert steps == [], "a finished sweep runs nothing"
    with pytest.raises(ValueError, match=r"lr=0.001,seed=0/finished.json records a finished run with other settings "
                                         r"\{'steps': \(2, 3\)\}"):
        sweep(SweepConfig(grid=("lr=1e-3,3e-3", "seed=0,1,2", "steps=3", f"policy={policy}", *SMOKE),
                          out_root=str(tmp_path)))
    assert steps == [], "refused before any point ran"


@dataclass(frozen=True)
class Fake:
    out_dir: str = ""
    """The point's folder."""
    x: int = 0
    """An axis."""
    y: str = "a"
    """Another."""


def _register_fake(monkeypatch, fail: set[tuple[int, str]]):
    calls = []

    def run(cfg: Fake) -> bool:
        calls.append((cfg.x, cfg.y))
        if (cfg.x, cfg.y) in fail:
            raise RuntimeError(f"point {cfg.x} {cfg.y} broke")
        rows = [{"step": s, "metric": "score", "value": cfg.x + s / 10} for s in (1, 2)]
        pd.DataFrame(rows).to_csv(Path(cfg.out_dir) / "metrics.csv", index=False)
        return True

    monkeypatch.setitem(EXPERIMENTS, "fake", Experiment(Fake, run))
    return calls


def test_a_failing_point_stops_no_other_and_only_it_is_rerun(tmp_path, monkeypatch, capsys):
    calls = _register_fake(monkeypatch, fail={(1, "b")})
    cfg = SweepConfig(experiment="fake", grid=("x=0,1", "y=a,b,c"), metric="score", out_root=str(tmp_path))
    with pytest.raises(RunFailed, match=r"point x=1,y=b failed \(1 of 6 points failed.*point 1 b broke"):
        sweep(cfg)
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    assert (tmp_path / "sweep_score.png").exists(), "the others' figure is drawn all the same"
    calls = _register_fake(monkeypatch, fail=set())
    assert main(["sweep", "fake", "x=0,1", "y=a,b,c", "--metric", "score", "--out-root", str(tmp_path)]) == 0
    assert calls == [(1, "b")], "only the failed point runs again"
    out = capsys.readouterr().out
    assert "x=1,y=b" in out and "skipped" in out and f"{tmp_path}/sweep_score.png" in out
    table = pd.read_csv(tmp_path / "metrics.csv")
    assert list(table.columns) == ["step", "metric", "value", "point", "x", "y"] and len(table) == 12
    assert json.loads((tmp_path / "x=1,y=b" / "finished.json").read_text())["settings"] == {"x": 1, "y": "b"}


def test_sweep_command_line_errors(tmp_path, monkeypatch, capsys):
    _register_fake(monkeypatch, fail=set())
    assert main(["sweep", "fake", "z=1,2", "--out-root", str(tmp_path / "a")]) == 2
    assert "unknown setting 'z' for Fake; valid settings: out_dir, x, y" in capsys.readouterr().err
    assert main(["sweep", "fake", "x=1,2", "--out-root", str(tmp_path / "b")]) == 2
    assert "no metric 'reward_mean'" in capsys.readouterr().err and (tmp_path / "b" / "x=2").is_dir()
    with pytest.raises(SystemExit):
        main(["sweep", "nightly", "x=1"])
    monkeypatch.chdir(tmp_path)
    assert runner.sweep_folder(SweepConfig(experiment="fake", grid=("x=1,2", "y=a"))) == Path("runs/sweeps/fake_x")


def _notebook(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text('# %% tags=["parameters"]\nsmoke = True\ndevice = "auto"\n'
                                       f'run_dir = "."\nseed = 0\nlabel = "a"\n\n# %%\n{body}\n')


def test_nightly_grid_runs_each_point_once(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    _notebook(nbs, "01_echo", "from pathlib import Path\nPath(run_dir, f'seed{seed}_{label}.txt').write_text('x')")
    cfg = NightlyConfig(scale="smoke", device="cpu", out_root=str(tmp_path / "runs"), notebooks_dir=str(nbs),
                        progress=False, grid=("seed=0,1", "label='x,y'"))
    root, status, passed = run_nightly(cfg)
    assert passed and root.name.startswith("grid-seed_") and list(status.point) == ["seed=0", "seed=1"]
    assert (root / "seed=1" / "seed1_x,y.txt").exists() and (root / "seed=0" / "executed" / "01_echo.ipynb").exists()
    executed = (root / "seed=0" / "executed" / "01_echo.ipynb").stat().st_mtime_ns
    root, status, passed = run_nightly(cfg)
    assert passed and status.skipped.all(), "a rerun skips the finished notebooks"
    assert (root / "seed=0" / "executed" / "01_echo.ipynb").stat().st_mtime_ns == executed
    assert "| seed=1 | 01_echo | ok (earlier) |" in (root / "summary.md").read_text()
    with pytest.raises(ValueError, match=r"unknown setting 'lr' for the parameters of 01_echo; valid settings: "
                                         "smoke, device, run_dir, seed, label"):
        run_nightly(NightlyConfig(device="cpu", notebooks_dir=str(nbs), out_root=str(tmp_path / "x"), grid=("lr=1",)))
    with pytest.raises(ValueError, match="seed must be int"):
        run_nightly(NightlyConfig(device="cpu", notebooks_dir=str(nbs), out_root=str(tmp_path / "x"),
                                  grid=("seed=a",)))
    with pytest.raises(ValueError, match="run_dir is set by the sweep"):
        run_nightly(NightlyConfig(device="cpu", notebooks_dir=str(nbs), out_root=str(tmp_path / "x"),
                                  grid=("run_dir=a,b",)))
    assert not (tmp_path / "x").exists(), "refused before any folder is made"

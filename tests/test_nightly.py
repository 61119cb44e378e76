"""The notebooks and the nightly runner: every notebook executes headless in smoke mode through
papermill, the run folder holds what it promises, and a failing notebook does not stop the others."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from workbench.__main__ import main
from workbench.env import git_sha, resolve_device
from workbench.nightly import NightlyConfig, notebook_paths, run_nightly

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


def _parameters_cell(path: Path) -> str:
    text = path.read_text()
    return text.split('# %% tags=["parameters"]\n', 1)[1].split("# %%", 1)[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_thin_and_parameterised(path):
    import jupytext

    notebook = jupytext.read(path)
    nbformat.validate(notebook)  # what JupyterLab (with jupytext) opens
    assert not any(c.get("outputs") for c in notebook.cells), "no executed output is committed"
    assert [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])], "a tagged parameters cell"
    cell = ast.parse(_parameters_cell(path))
    names = {t.id for node in cell.body for t in node.targets}
    assert {"smoke", "device", "run_dir"} <= names
    assert all(isinstance(node.value, ast.Constant) for node in cell.body), "the parameters cell holds literals only"
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert all(a.name != "*" for a in node.names), f"{path.name}: no star imports"
        assert not isinstance(node, (ast.FunctionDef, ast.ClassDef)), f"{path.name}: logic belongs in the package"


def _this_commits_nightly() -> Path | None:
    """The finished CPU nightly that CI's set-up step ran from this very commit (a clean tree: `git_sha` has no
    '-dirty'), if there is one: checking its folder takes seconds, running it again 7 minutes on 2 cores."""
    sha = git_sha(ROOT)
    if sha == "unknown" or sha.endswith("-dirty"):
        return None
    root = ROOT / "runs" / "nightly"   # <date>_<sha>, or <date>_<sha>_<time> when that folder existed
    for folder in sorted([*root.glob(f"*_{sha}"), *root.glob(f"*_{sha}_*")], reverse=True):
        if not all((folder / f).exists() for f in ("summary.md", "env.json", "config.yaml", "status.csv")):
            continue   # a run still going, or one that was cut off
        settings = yaml.safe_load((folder / "config.yaml").read_text())
        # Only the set-up's own run on this CPU (smoke, every notebook, no named inputs): a `--only 01` or `--policy`
        # run tells less.
        cpu_smoke = settings["scale"] != "full" and resolve_device(settings["device"]) == "cpu"
        if cpu_smoke and not any(settings[k] for k in ("only", "policy", "metrics", "grid")):
            return folder
    return None


@pytest.mark.slow   # when no nightly of this commit is there to check
def test_smoke_nightly_runs_every_notebook(tmp_path):
    folder = _this_commits_nightly()
    if folder is None:
        # A 10-minute cell limit: a hung cell fails the suite in minutes, not after the default hour.
        folder, status, passed = run_nightly(NightlyConfig(scale="smoke", device="cpu", out_root=str(tmp_path),
                                                           progress=False, cell_timeout=600))
        assert passed, status.to_string()
    status = pd.read_csv(folder / "status.csv")
    assert (status.status == "ok").all(), status.to_string()
    assert list(status.notebook) == [p.stem for p in NOTEBOOKS]
    for p in NOTEBOOKS:
        executed = nbformat.read(folder / "executed" / f"{p.stem}.ipynb", as_version=4)
        injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
        assert injected and "smoke = True" in injected[0].source
        assert any(c.get("outputs") for c in executed.cells if c.cell_type == "code")
        params = yaml.safe_load((folder / "params" / f"{p.stem}.yaml").read_text())
        assert params["smoke"] is True and resolve_device(params["device"]) == "cpu"
        assert params.get("interactive", False) is False, "no widget is built headless (nbclient#312)"
        assert (folder / "logs" / f"{p.stem}.log").exists()
    env = json.loads((folder / "env.json").read_text())
    assert {"git_sha", "python", "torch", "triton", "cuda", "gpu", "kernel_configs"} <= set(env)
    for table in ("batch_variance", "kernel_audit", "divergence", "parity_triangle_pairs", "on_off", "token_mismatch"):
        assert (folder / "metrics" / f"{table}.csv").exists(), table
    for figure in ("kernel_audit", "logprob_differences", "on_off_blog", "mismatch_realistic",
                   "dose_response_blog-dose"):
        assert (folder / "figures" / f"{figure}.svg").exists() and (folder / "figures" / f"{figure}.png").exists()
    summary = (folder / "summary.md").read_text()
    assert f"{len(NOTEBOOKS)} of {len(NOTEBOOKS)} ok" in summary and "parity: pass (5 of 5 checks ran)" in summary
    assert "| blog | on |" in summary and "| blog-dose | noise=0.01 |" in summary and "| realistic | off |" in summary
    assert summary.count("| pass |") == 5
    assert "Smoke scale" in summary and "not results" in summary, "a smoke run says its figures are no results"
    # No GPU: a CPU control beside standard, and the published GPU results beside this run's.
    audit = pd.read_csv(folder / "metrics" / "kernel_audit.csv")
    assert set(audit["mode"]) == {"invariant", "standard", "standard fp32"}
    assert "standard fp32: " in summary and "all standard, fp32 (CPU control): " in summary
    assert set(pd.read_csv(folder / "metrics" / "parity_triangle_pairs.csv").variant) == \
        {"invariant", "standard", "standard fp32"}
    for name in ("02_kernel_parity_audit", "03_generator_vs_trainer", "05_on_off_plots"):
        assert "published, GPU" in (folder / "executed" / f"{name}.ipynb").read_text(), name
    table = pd.read_csv(folder / "metrics" / "on_off.csv")
    std = table.query("metric == 'parity_tokens_differing' and variant == 'off'")
    assert ("ON and OFF are the same run here" in summary) == (std.value.sum() == 0), \
        "the summary says so exactly when the OFF arm matched the ON arm on every step"
    kl = table.query("metric == 'sampler_trainer_kl' and preset == 'blog-dose'").groupby("variant").value.mean()
    assert kl["on"] == 0 < kl["noise=0.01"], "the dose-response knob makes a mismatch, `on` has none"


def _notebook(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.py").write_text('# %% tags=["parameters"]\nsmoke = True\ndevice = "auto"\n'
                                       f'run_dir = "."\n\n# %%\n{body}\n')


def test_a_failing_notebook_is_reported_and_the_others_still_run(tmp_path, capsys):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    _notebook(nbs, "01_first", "print('first ran')")
    _notebook(nbs, "02_broken", "raise ValueError('deliberately broken')")
    _notebook(nbs, "03_last", "print('last ran')")
    folder, status, passed = run_nightly(NightlyConfig(scale="smoke", device="cpu", out_root=str(tmp_path / "runs"),
                                                       notebooks_dir=str(nbs), progress=False))
    assert not passed
    assert list(status.status) == ["ok", "failed", "ok"]
    assert "deliberately broken" in status.error[1]
    summary = (folder / "summary.md").read_text()
    assert "2 of 3 ok (FAILED)" in summary and "parity: not run (0 of 5 checks ran)" in summary
    assert (folder / "executed" / "03_last.ipynb").exists()
    code = main(["nightly", "--scale", "smoke", "--device", "cpu", "--notebooks-dir", str(nbs), "--only", "01", "02",
                 "--out-root", str(tmp_path / "cli"), "--no-progress"])
    assert code == 1, "the exit code says not all passed"


def test_bad_nightly_inputs(tmp_path):
    with pytest.raises(ValueError, match="scale must be"):
        NightlyConfig(scale="huge")
    with pytest.raises(FileNotFoundError, match="no numbered notebooks"):
        notebook_paths(tmp_path)
    with pytest.raises(ValueError, match="scale 'full' .* needs a GPU"):
        run_nightly(NightlyConfig(scale="full", device="cpu", out_root=str(tmp_path / "full")))
    with pytest.raises(ValueError, match=r"no notebook \['09'\]"):
        notebook_paths(ROOT / "notebooks", ("09",))
    (tmp_path / "01_bare.py").write_text("# %% tags=[\"parameters\"]\nx = 1\n")
    folder, status, passed = run_nightly(NightlyConfig(scale="smoke", device="cpu", out_root=str(tmp_path / "r"),
                                                       notebooks_dir=str(tmp_path), progress=False))
    assert not passed and "lacks ['device', 'run_dir', 'smoke']" in status.error[0]


@pytest.mark.slow   # 22 s on 2 cores: it draws the published regime map, its curves among them
def test_the_plots_notebook_redraws_any_run(tmp_path):
    rows = [{"step": s, "metric": "reward_mean", "value": s / 10, "variant": v, "seed": 0}
            for s in (1, 2, 3) for v in ("invariant", "standard")]
    pd.DataFrame(rows).to_csv(tmp_path / "old.csv", index=False)
    folder, status, passed = run_nightly(NightlyConfig(scale="smoke", device="cpu", out_root=str(tmp_path / "r"),
                                                       only=("05",), metrics=str(tmp_path / "old.csv"),
                                                       progress=False))
    assert passed and (folder / "figures" / "on_off.png").exists()
    assert not (folder / "figures" / "mismatch.png").exists()
    assert "published, GPU" in (folder / "executed" / "05_on_off_plots.ipynb").read_text()
    assert yaml.safe_load((folder / "params" / "05_on_off_plots.yaml").read_text())["metrics"].endswith("old.csv")


def test_named_inputs_are_checked_before_any_notebook_runs(tmp_path):
    from workbench.models import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        run_nightly(NightlyConfig(policy=str(tmp_path / "missing"), out_root=str(tmp_path / "n")))
    with pytest.raises(FileNotFoundError, match="no table at"):
        run_nightly(NightlyConfig(metrics=str(tmp_path / "missing"), out_root=str(tmp_path / "n")))
    with pytest.raises(ValueError, match=r"^nightly --grid: grid item 'presets=' has no value"):
        run_nightly(NightlyConfig(grid=("presets=",), out_root=str(tmp_path / "n")))
    assert not (tmp_path / "n").exists(), "refused before the run folder exists"


def test_notebook_run_dirs_resolve_against_the_project_root(tmp_path, monkeypatch):
    from workbench.tables import project_path

    monkeypatch.chdir(tmp_path)  # as a kernel started in notebooks/
    root = Path(__file__).resolve().parents[1]
    assert project_path("runs/notebooks") == root / "runs" / "notebooks"
    assert project_path(tmp_path / "x") == tmp_path / "x"


def test_the_nightly_hands_tensorboard_to_the_rl_notebook(tmp_path):
    from workbench.nightly import _parameters

    declared = {"smoke": None, "device": None, "run_dir": None, "policy": None, "tensorboard": None}
    on = _parameters(Path("04_rl_training.py"), declared, NightlyConfig(tensorboard=True), True, tmp_path)
    off = _parameters(Path("04_rl_training.py"), declared, NightlyConfig(), True, tmp_path)
    assert on["tensorboard"] is True and "tensorboard" not in off
    assert "tensorboard = False" in (ROOT / "notebooks" / "04_rl_training.py").read_text()
    from workbench.onoff.config import preset

    assert preset("blog", smoke=True, tensorboard=True).run.tensorboard
    assert preset("blog", smoke=True).run_config("on", 0).tensorboard is False


def test_the_newest_published_nightly_with_the_table_is_shown_labelled(tmp_path):
    from workbench.published import published_nightly
    from workbench.records import Record, write_index, write_record

    for name, gpu in (("2026-11-01_nightly-h100_aaa", "NVIDIA H100"), ("2026-11-05_nightly-h200_bbb", "NVIDIA H200"),
                      ("2026-11-09_nightly-h100_ccc", "NVIDIA H100 80GB HBM3"), ("2026-11-12_onoff-h100_ddd", "x")):
        (tmp_path / name).mkdir()
        # The kind, device and date come from the record, not from the folder's name.
        write_record(tmp_path / name, Record(name, "nightly" if "nightly" in name else "rl", "q", {}, gpu, "aaa",
                                             name[:10], "python -m workbench nightly", "v"))
    write_index(tmp_path)
    for name in ("2026-11-01_nightly-h100_aaa", "2026-11-05_nightly-h200_bbb", "2026-11-12_onoff-h100_ddd"):
        pd.DataFrame({"op": ["linear"], "mode": ["standard"]}).to_csv(tmp_path / name / "kernel_audit.csv")
    (tmp_path / "2026-11-05_nightly-h200_bbb" / "kernel_audit.png").write_bytes(b"png")
    found = published_nightly("kernel_audit", figure="kernel_audit", root=tmp_path)
    assert found.folder.name == "2026-11-05_nightly-h200_bbb", "the newest nightly that has the table"
    assert found.label == "published, GPU, NVIDIA H200, 2026-11-05" and found.figure.name == "kernel_audit.png"
    assert list(found.table.op) == ["linear"]
    assert published_nightly("divergence", root=tmp_path) is None
    real = published_nightly("parity_triangle_pairs", figure="logprob_differences")
    assert real is not None and real.label.startswith("published, GPU, NVIDIA H100") and real.figure.exists(), \
        "docs/results/index.json lists a full-scale nightly for notebook 03 to show"

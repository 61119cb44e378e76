"""The nightly run: every numbered notebook, headless through papermill, into one dated folder.

`runs/nightly/<date>_<git sha>/` gets:
- `executed/NN_name.ipynb`: the executed notebooks, never edited afterwards;
- `params/NN_name.yaml`: the parameters each notebook ran with;
- `logs/NN_name.log`: the notebook's stdout and stderr;
- `env.json`: git sha, versions of python / torch / triton / CUDA, the GPU, the kernel configs;
- `metrics/*.csv`, `figures/*.svg|png`: what the notebooks wrote (their `run_dir` is this folder);
- `status.csv` and `summary.md`: per notebook ok/failed and its time, the parity checks, and the
  final rewards per mode.

With `grid` (`--grid seed=0,1 presets=blog`: the sweep's grid syntax over the notebooks' parameters, each checked
against every chosen notebook's parameters cell) every point of the grid is such a folder,
`runs/nightly/grid-<swept parameters>_<git sha>/<point>/`, with `status.csv` and `summary.md` of all points beside
them. A notebook that ran to the end is marked (`finished/NN_name.json`); in a grid's folder the next call skips it.

Notebooks are jupytext "percent" files (`notebooks/NN_name.py`), converted to .ipynb on the fly.
A failing notebook is recorded and the next one runs; `run_nightly` reports whether all passed.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import json
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .config import write_config
from .env import environment_record, git_sha, resolve_device
from .files import make_folder
from .models.hub import resolve_model
from .onoff.stats import final_reward_words, run_endpoints
from .rundir import claim
from .sweep.grid import finished, mark_finished, parse_grid, point_names, points, swept
from .tables import load_table


@dataclass(frozen=True)
class NightlyConfig:
    scale: str = "auto"
    """'smoke' (seconds per notebook, CPU-sized), 'full' (the GPU experiments), or 'auto' (full on a GPU)."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto'."""
    out_root: str = "runs/nightly"
    """The dated run folder is created below this."""
    notebooks_dir: str = "notebooks"
    """Where the numbered notebooks (NN_name.py, jupytext percent format) are."""
    only: tuple[str, ...] = ()
    """Run only these notebooks (numbers such as 01 04, or names); empty: all, in order."""
    policy: str = ""
    """A real policy for notebooks 03 and 04 (registry name, folder, .gguf or hub id); empty: random/self-trained."""
    metrics: str = ""
    """A metrics table (or a run folder) for the plots notebook to draw instead of this run's."""
    tensorboard: bool = False
    """Also write the RL notebook's runs to TensorBoard (in the run folder's work/on_off/<run>/tensorboard)."""
    cell_timeout: int = 3600
    """Seconds a single cell may run before it counts as failed."""
    progress: bool = True
    """Show papermill's progress bar per notebook."""
    grid: tuple[str, ...] = ()
    """Notebook parameters to sweep, param=v1,v2 per item (--grid seed=0,1 presets=blog,realistic): every combination
    runs the chosen notebooks once, into out_root/grid-<swept parameters>_<git sha>/<point>/; a rerun skips those that
    finished."""

    def __post_init__(self):
        if self.scale not in ("smoke", "full", "auto"):
            raise ValueError(f"scale must be 'smoke', 'full' or 'auto', got {self.scale!r}")
        resolve_device(self.device)
        if self.cell_timeout < 1:
            raise ValueError(f"cell_timeout must be >= 1, got {self.cell_timeout}")


def notebook_paths(folder: str | Path, only: tuple[str, ...] = ()) -> list[Path]:
    """The numbered notebooks NN_name.py in order, optionally only those named in `only`."""
    folder = Path(folder)
    found = sorted(p for p in folder.glob("[0-9][0-9]_*.py"))
    if not found:
        raise FileNotFoundError(f"no numbered notebooks (NN_name.py) in {folder}")
    if only:
        wanted = set(only)
        chosen = [p for p in found if p.stem[:2] in wanted or p.stem in wanted]
        unknown = wanted - {p.stem[:2] for p in chosen} - {p.stem for p in chosen}
        if unknown:
            raise ValueError(f"no notebook {sorted(unknown)} in {folder}; there are {[p.stem for p in found]}")
        found = chosen
    return found


def run_folder(root: str | Path) -> Path:
    """runs/nightly/<YYYY-MM-DD>_<sha>, with a time suffix when that folder exists already."""
    base = Path(root) / f"{datetime.date.today().isoformat()}_{git_sha()}"
    if base.exists():
        base = base.with_name(base.name + datetime.datetime.now().strftime("_%H%M%S"))
    return base


def _parameters(path: Path, declared: dict, cfg: NightlyConfig, smoke: bool, run_dir: Path,
                point: dict | None = None) -> dict:
    # interactive=False: no widgets. A widget's comm messages can leave papermill waiting forever on a cell whose
    # kernel is idle (nbclient#312, papermill#723); seen here on notebook 01's explorer.
    offered = {"smoke": smoke, "device": cfg.device, "run_dir": str(run_dir.resolve()), "interactive": False}
    if cfg.policy:
        offered["policy"] = cfg.policy
    if cfg.metrics:
        offered["metrics"] = str(Path(cfg.metrics).resolve())
    if cfg.tensorboard:
        offered["tensorboard"] = True
    offered.update(point or {})  # a grid point's own values win
    missing = {"smoke", "device", "run_dir"} - set(declared)
    if missing:
        raise ValueError(f"{path.name}: its parameters cell lacks {sorted(missing)}")
    return {k: v for k, v in offered.items() if k in declared}


def _declared(path: Path, source: Path) -> dict:
    """The notebook's parameters cell as papermill reads it, the jupytext file converted to `source` (.ipynb)."""
    import jupytext
    import nbformat
    import papermill

    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    source.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, source)
    return papermill.inspect_notebook(str(source))


def run_notebook(path: Path, folder: Path, cfg: NightlyConfig, smoke: bool, point: dict | None = None) -> dict:
    """Execute one notebook into folder/executed (with a grid point's parameters); returns its status row (never
    raises for the notebook). One that finished in this folder with the same parameters is skipped."""
    import papermill
    import yaml

    name = path.stem
    start = time.perf_counter()
    row = {"notebook": name, "status": "ok", "seconds": 0.0, "error": "", "skipped": False}
    try:
        source = folder / "work" / "notebooks" / f"{name}.ipynb"
        params = _parameters(path, _declared(path, source), cfg, smoke, folder, point)
        marker = folder / "finished" / f"{name}.json"
        settings = {k: v for k, v in params.items() if k != "run_dir"}  # the folder may move
        if finished(marker, settings):
            return {**row, "seconds": json.loads(marker.read_text())["seconds"], "skipped": True}
        (folder / "params" / f"{name}.yaml").write_text(yaml.safe_dump(params, sort_keys=True))
        with open(folder / "logs" / f"{name}.log", "w") as log:
            papermill.execute_notebook(str(source), str(folder / "executed" / f"{name}.ipynb"), parameters=params,
                                       kernel_name="python3", progress_bar=cfg.progress, stdout_file=log,
                                       stderr_file=log, execution_timeout=cfg.cell_timeout, cwd=str(Path.cwd()))
        mark_finished(marker, settings, seconds=round(time.perf_counter() - start, 1))
    except Exception as e:  # a failing notebook is recorded; the next one still runs
        row["status"] = "failed"
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        row["error"] = _first_error(lines) or traceback.format_exception_only(type(e), e)[-1].strip()
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def _first_error(lines: list[str]) -> str:
    """The exception line of a papermill error message (ANSI colours removed)."""
    clean = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in lines]
    for ln in reversed(clean):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln):
            return ln[:300]
    return clean[-1][:300] if clean else ""


def parity_checks(folder: Path) -> pd.DataFrame:
    """The bitwise claims, read from the tables the notebooks wrote (a missing table is 'not run')."""
    metrics = folder / "metrics"
    checks = []

    def check(name, file, fn):
        path = metrics / f"{file}.csv"
        if not path.exists():
            checks.append({"check": name, "result": "not run", "detail": f"no metrics/{file}.csv"})
            return
        ok, detail = fn(pd.read_csv(path))
        checks.append({"check": name, "result": "pass" if ok else "FAIL", "detail": detail})

    def audit(t):
        inv = t[t["mode"] == "invariant"]
        if inv.empty:
            return False, "no invariant rows in the table"
        bad = inv[~inv.bitwise_equal.astype(bool)]
        # standard, and on a CPU its fp32 control
        others = "; ".join(f"{m}: {int((~g.bitwise_equal.astype(bool)).sum())} of {len(g)} cases differ"
                           for m, g in t[t["mode"] != "invariant"].groupby("mode", sort=True))
        return bad.empty, (f"{len(inv)} invariant cases bitwise equal; {others}"
                           if bad.empty else f"{len(bad)} invariant cases differ: {sorted(set(bad.op))}")

    def divergence(t):
        row = t[t.setting == "all invariant"]
        ok = not row.empty and int(row.ops_differing.iloc[0]) == 0
        std = t[t.setting.str.startswith("all standard")]  # on a CPU also its fp32 control
        firsts = "; ".join(f"{r.setting}: {r.first_divergence}" for r in std.itertuples()) or "standard: -"
        return ok, f"invariant: {'no op differs' if ok else 'ops differ'}; first divergence, {firsts}"

    def triangle(t):
        inv = t[t.variant == "invariant"]
        ok = not inv.empty and int(inv.tokens.min()) > 0 and bool(inv.bitwise_identical.astype(bool).all())
        ends = t[t.pair == "decode vs train"].set_index("variant")
        detail = "; ".join(f"{v}: {int(r.tokens_differing)} of {int(r.tokens)} tokens differ (decode vs train)"
                           for v, r in ends.iterrows())
        return ok, detail

    def rl(t):
        par = t[t.metric == "parity_tokens_differing"]
        on, off = par[par.variant == "on"], par[par.variant != "on"]
        ok = not on.empty and bool((on.value == 0).all())
        return ok, (f"on: {int(on.value.sum())} differing tokens over {len(on)} run-steps; the other arms: "
                    f"{int(off.value.sum())} over {len(off)}")

    check("kernel audit (02): invariant rows bitwise equal in every batch", "kernel_audit", audit)
    check("first divergence (02): whole model, trainer = decode", "divergence", divergence)
    check("generator vs trainer (03): decode = prefill = train", "parity_triangle_pairs", triangle)
    def tokens(t):
        inv = t[t.arm == "invariant"]
        ok = not inv.empty and bool((inv.sampler_logprob == inv.trainer_logprob).all())
        return ok, "; ".join(f"{arm}: {int((g.sampler_logprob != g.trainer_logprob).sum())} of {len(g)} tokens differ"
                             for arm, g in t.groupby("arm", sort=False))

    check("RL (04): zero differing tokens at every step of the `on` arm", "on_off", rl)
    check("token view (06): sampler = trainer on every invariant token", "token_mismatch", tokens)
    return pd.DataFrame(checks)


def final_rewards(folder: Path) -> tuple[pd.DataFrame, str] | None:
    """Per (preset,) arm: the final reward (`onoff.stats.run_endpoints`, the on-off report's) averaged over seeds,
    with the definition in words."""
    path = folder / "metrics" / "on_off.csv"
    if not path.exists():
        return None
    t = pd.read_csv(path)
    groups = t.groupby("preset", sort=False) if "preset" in t else [(None, t)]
    tables = [run_endpoints(g).assign(preset=name) for name, g in groups]
    runs = pd.concat(tables, ignore_index=True)
    keys = ["preset", "variant"] if "preset" in t else ["variant"]
    table = (runs.groupby(keys, sort=False).final_reward.agg(["mean", "count"]).reset_index()
             .rename(columns={"mean": "final reward (mean over seeds)", "count": "runs"}))
    return table, final_reward_words(int(runs.steps.min()))


def parity_verdict(checks: pd.DataFrame) -> str:
    """'FAIL' if any check failed, 'pass' if some passed and none failed, 'not run' if none ran."""
    if (checks.result == "FAIL").any():
        return "FAIL"
    return "pass" if (checks.result == "pass").any() else "not run"


def caveats(folder: Path, scale: str, env: dict) -> list[str]:
    """What this run's figures cannot show, said where a reader of summary.md sees it first."""
    out = []
    if scale == "smoke":
        out.append("Smoke scale: a tiny model, a few steps, one seed. The figures check that the pipeline runs; "
                   "they are not results (no trend, no confidence interval).")
    if not env.get("gpu"):
        out.append("No GPU: notebooks 02 and 03 add a CPU control, the standard kernels in fp32 (`standard fp32`, "
                   "where a CPU's BLAS may sum one row in another order than a batch), and show the newest published "
                   "GPU results from docs/results after this run's, as notebook 05 does; each is labelled "
                   "\"published, GPU, <device>, <date>\".")
    path = folder / "metrics" / "on_off.csv"
    if path.exists():
        t = pd.read_csv(path)
        std = t[(t.metric == "parity_tokens_differing") & (t.variant == "off")]
        if not std.empty and int(std.value.sum()) == 0:
            where = "this CPU (Triton interpreter)" if env.get("triton_interpreter") else "this machine"
            out.append(f"The OFF arm (standard) matched the ON arm bit for bit on every step on {where}: its "
                       "standard kernels did not vary with the batch, so ON and OFF are the same run here and the "
                       "reward curves can show no ON/OFF effect. The mismatch appears on a GPU (cuBLAS, flash "
                       "attention).")
    return out


def summary_markdown(folder: Path, status: pd.DataFrame, env: dict, scale: str) -> str:
    ok = (status.status == "ok").all()
    checks = parity_checks(folder)
    ran = int((checks.result != "not run").sum())
    lines = [f"# Nightly run {folder.name}", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; git {env['git_sha']}; scale {scale}",
             f"- device: {env['gpu'] or 'CPU'}{' (Triton interpreter)' if env['triton_interpreter'] else ''}; "
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, python {env['python']}",
             f"- notebooks: {int((status.status == 'ok').sum())} of {len(status)} ok"
             f"{'' if ok else ' (FAILED)'}; parity: {parity_verdict(checks)} ({ran} of {len(checks)} checks ran)",
             ""]
    notes = caveats(folder, scale, env)
    if notes:
        lines += [f"> **Note.** {n}" for n in notes] + [""]
    lines += ["| notebook | status | seconds | error |", "|---|---|---|---|"]
    for r in status.itertuples(index=False):
        lines.append(f"| {r.notebook} | {r.status} | {r.seconds:.1f} | {r.error.replace('|', '/')} |")
    lines += ["", "| parity check | result | detail |", "|---|---|---|"]
    for r in checks.itertuples(index=False):
        lines.append(f"| {r.check} | {r.result} | {r.detail} |")
    found = final_rewards(folder)
    if found is not None:
        rewards, words = found
        keys = list(rewards.columns[:-2])  # (preset,) arm
        lines += ["", words, "", "| " + " | ".join(keys + list(rewards.columns[-2:])) + " |",
                  "|---" * len(rewards.columns) + "|"]
        for r in rewards.itertuples(index=False):
            lines.append("| " + " | ".join(map(str, r[:-2])) + f" | {r[-2]:.4f} | {r[-1]} |")
    figures = sorted((folder / "figures").glob("*.png")) if (folder / "figures").exists() else []
    if figures:
        lines += ["", "Figures: " + ", ".join(f"figures/{p.name}" for p in figures)]
    return "\n".join(lines) + "\n"


def run_nightly(cfg: NightlyConfig) -> tuple[Path, pd.DataFrame, bool]:
    """Run the notebooks in order (at every point of cfg.grid); returns (run folder, status table, all passed)."""
    paths = notebook_paths(cfg.notebooks_dir, cfg.only)
    if cfg.scale == "full" and resolve_device(cfg.device) == "cpu":
        raise ValueError("scale 'full' runs the Qwen3-1.7B shape and 600 GRPO steps: it needs a GPU (in Triton's "
                         "CPU interpreter it would take days); use --scale smoke or auto on this machine")
    # Named inputs are checked before any notebook runs (a missing one would fail minutes in, inside a notebook).
    if cfg.policy:
        resolve_model(cfg.policy)
    if cfg.metrics:
        load_table(cfg.metrics, "on_off")
    smoke = cfg.scale == "smoke" or (cfg.scale == "auto" and resolve_device(cfg.device) == "cpu")
    axes = notebook_grid(cfg.grid, paths) if cfg.grid else None  # a bad grid is refused before any folder is made
    make_folder(cfg.out_root)
    # The run's folder (a grid's root) is locked while the notebooks write into it: a second process is refused.
    folder = grid_folder(cfg, axes) if axes is not None else run_folder(cfg.out_root)
    with claim(folder, "nightly", option="--out-root"):
        if axes is not None:
            return run_grid(cfg, axes, paths, smoke)
        return (folder, *run_notebooks(folder, cfg, paths, smoke))


def run_notebooks(folder: Path, cfg: NightlyConfig, paths: list[Path], smoke: bool,
                  point: dict | None = None) -> tuple[pd.DataFrame, bool]:
    """The notebooks into one run folder (with a grid point's parameters); returns (status table, all passed)."""
    scale = "smoke" if smoke else "full"
    for sub in ("executed", "params", "logs", "metrics", "figures", "finished"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    write_config(cfg, folder / "config.yaml")
    env = environment_record()
    (folder / "env.json").write_text(json.dumps(env, indent=1, default=str))
    print(f"nightly ({scale}, {resolve_device(cfg.device)}): {len(paths)} notebooks -> {folder}", flush=True)
    rows = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.stem} ...", flush=True)
        row = run_notebook(path, folder, cfg, smoke, point)
        print(f"[{i}/{len(paths)}] {path.stem}: {row['status']} in {row['seconds']:.1f} s"
              + (" (finished earlier: skipped)" if row["skipped"] else "")
              + (f" ({row['error']})" if row["error"] else ""), flush=True)
        rows.append(row)
    status = pd.DataFrame(rows)
    status.to_csv(folder / "status.csv", index=False)
    (folder / "summary.md").write_text(summary_markdown(folder, status, env, scale))
    passed = bool((status.status == "ok").all()) and bool((parity_checks(folder).result != "FAIL").all())
    return status, passed


def notebook_grid(items: tuple[str, ...], paths: list[Path]) -> dict[str, list]:
    """The grid's axes, each parameter declared by every notebook in `paths` and each value of its default's type
    (bool, int, float or str); run_dir is the nightly's."""
    import tempfile

    axes: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            fields = []
            for name, declared in _declared(path, Path(tmp) / "nb.ipynb").items():
                try:
                    value = ast.literal_eval(declared["default"])
                except (ValueError, SyntaxError):  # an expression, not a literal: no type to check a value against
                    continue
                if type(value) in (bool, int, float, str):
                    fields.append((name, type(value), value))
            try:
                axes = parse_grid(items, dataclasses.make_dataclass(f"the parameters of {path.stem}", fields),
                                  "run_dir")
            except ValueError as e:
                raise ValueError(f"nightly --grid: {e}") from None
    return axes


def grid_folder(cfg: NightlyConfig, axes) -> Path:
    """A grid's folder: out_root/grid-<swept parameters>_<git sha>."""
    return Path(cfg.out_root) / f"grid-{'-'.join(swept(axes)) or 'single'}_{git_sha()}"


def run_grid(cfg: NightlyConfig, axes, paths: list[Path], smoke: bool) -> tuple[Path, pd.DataFrame, bool]:
    """The notebooks at every point of the grid `axes` (`notebook_grid` of cfg.grid), each point in its own folder;
    returns (grid folder, status of every point's notebooks, all passed)."""
    fields, grid, root = swept(axes), points(axes), grid_folder(cfg, axes)
    tables, passed = [], True
    for name, point in zip(point_names(grid, fields), grid):
        print(f"grid point {name}", flush=True)
        status, ok = run_notebooks(root / name, cfg, paths, point.get("smoke", smoke), point)
        tables.append(status.assign(point=name))
        passed = passed and ok
    status = pd.concat(tables, ignore_index=True)
    status.to_csv(root / "status.csv", index=False)
    head = (f"{int((status.status == 'ok').sum())} of {len(status)} notebooks ok over {len(grid)} points"
            f"{'' if passed else ' (FAILED)'}; each point's summary.md has its checks.")
    lines = [f"# Nightly grid {root.name}", "", head, "", "| point | notebook | status | seconds | error |",
             "|---|---|---|---|---|"]
    lines += [f"| {r.point} | {r.notebook} | {r.status}{' (earlier)' if r.skipped else ''} | {r.seconds:.1f} | "
              f"{r.error.replace('|', '/')} |" for r in status.itertuples(index=False)]
    (root / "summary.md").write_text("\n".join(lines) + "\n")
    return root, status, passed

"""The experiment's report, drawn only from its folder: summary.md (the verdict, the dose-response slope, the
table of endpoints, the caveats: the words are `report_text`'s), the figures as SVG and PNG, and the long metrics
table, in out_dir/report/;
`publish` copies that folder to <dest>/<date>_onoff-<preset>-<device>_<sha>/ (docs/results for the records) with its
result.json, and regenerates dest's index (`workbench.records`),
`reissue` rewrites a published folder's statistics from its own files, and `published_results` lists the newest
published record per preset, found through that index, for a reader without a GPU.

An experiment of one arm (`arms=[off]`: one arm of a regime-map cell, or a part of its seeds, run inside one GPU
hold) is published as an arm record: its folder named by the arm, length, loss and seeds, its preset
`<preset>-arm`, and its report calling nothing (`regime_record` pairs the arms of a cell from their records;
`arm_records` splits an experiment of several arms into such records)."""

from __future__ import annotations

import datetime
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..config import read_config_file
from ..plots import save_figure
from ..published import published_label
from ..records import Figure, Record, load_index, write_index, write_record
from ..tables import project_path
from .comparison_figures import dose_response_figure, regime_map
from .config import OnOffConfig
from .figures import delta_histogram, mismatch_panels, reward_curves
from .regime_plan import WINDOW as PLAN_WINDOW, recorded_settings
from .report_text import (COLUMNS, arm_verdict, regime_markdown, seed_span, summary_markdown,
                          unfinished_markdown)
from .runner import POLICY_RECORD, collect, finished_runs
from .stats import CELL, dose_response, regime_table, summarize

def _deltas(out: Path, variants) -> dict[str, np.ndarray]:
    """Per arm, the first step's per-token |Δ log-prob| of its lowest seed's run (the starting policy's mismatch)."""
    found = {}
    for variant in variants:
        runs = sorted(out.glob(f"{_glob_escape(variant)}-seed*/step1_logprobs.npz"),
                      key=lambda p: int(p.parent.name.rsplit("seed", 1)[1]))
        if runs:
            with np.load(runs[0]) as f:
                found[variant] = np.abs(f["generator"] - f["trainer"])
    return found


_OWN_SAMPLES = ("on", "off", "on-vllm", "off-vllm")
"""Arms whose generator differs (the others reuse one of these generators and differ in the update only)."""


def _glob_escape(name: str) -> str:
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def report(out_dir: str | Path, window: int = 10, smooth: int = 5) -> Path:
    """Write out_dir/report/ from the runs in out_dir; returns that folder. Endpoints use finished runs only; the
    curves show every step any run reached, so a run cut short still shows how far it got."""
    out = Path(out_dir)
    table = collect(out)
    folder = out / "report"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    cfg = OnOffConfig(**read_config_file(out / "config.yaml", OnOffConfig))
    # The run-level metrics, which every view reads; the per-layer-group weight changes (weight_delta_l2/layer_03:
    # two thirds of the rows at 30 layers) stay in the runs' own metrics.csv. Records travel to the GPU with every
    # call of the device, inside its 64 MiB.
    table[~table.metric.str.contains("/", regex=False)].to_csv(folder / "metrics.csv.gz", index=False)
    for name in ("runs.csv", "invocations.csv", "config.yaml", POLICY_RECORD):
        if (out / name).exists():
            shutil.copy(out / name, folder / name)
    # Arms that differ only in what the update does with the log-probs share step 1's: one of them is enough.
    deltas = _deltas(out, [v for v in sorted(set(table.variant)) if v in _OWN_SAMPLES or v.startswith("noise=")])
    if deltas:
        histogram = delta_histogram({f"{v} (step 1)": d for v, d in deltas.items()},
                                    title="per-token mismatch at step 1 (the starting policy)")
        _save(histogram, folder, "delta_histogram", cfg)
    write_report(folder, window, smooth)
    return folder


def _is_arm(cfg: OnOffConfig) -> bool:
    """An experiment of one arm, published as an arm record: the regime map's unit, of which it holds dozens. Their
    figures are PNG only, at ARM_DPI (the map's own record has the SVGs): every record travels to the GPU with each
    call of the device, inside its 64 MiB beside the model's parts."""
    return len(cfg.arms) == 1


ARM_DPI = 80
"""An arm record's PNG resolution: under a third of the pixels of the default 150 dpi, still legible on screen."""


def _save(fig, folder: Path, name: str, cfg: OnOffConfig) -> None:
    save_figure(fig, folder, name, **({"svg": False, "dpi": ARM_DPI} if _is_arm(cfg) else {}))


def write_report(folder: str | Path, window: int = 10, smooth: int = 5, header: list[str] | None = None,
                 note: str = "") -> None:
    """summary.md, summary.csv, dose_response.csv and the figures of a report folder, from its own files
    (metrics.csv.gz, runs.csv, invocations.csv, config.yaml): what `report` writes, and how `reissue` rewrites a
    published one. `header` replaces the generated title and facts lines; `note` is a paragraph put under them.
    A delta_histogram.png already there (it needs the runs' step-1 log-probs, which are not published) is kept.

    A table with `max_new_tokens` and `loss` columns is a regime experiment: its verdict is `stats.regime_table`'s
    per cell (summary.csv and the `regime_map` figure, which also shows each cell's mismatch), and its reward
    curves get a panel per cell, so that nothing is averaged across cells."""
    folder = Path(folder)
    cfg = OnOffConfig(**read_config_file(folder / "config.yaml", OnOffConfig))
    table = pd.read_csv(folder / "metrics.csv.gz")
    done = finished_runs(table, folder)
    name = f"`{cfg.preset or 'custom'}`"
    steps = int(table.step.max())
    smooth = smooth if steps >= 4 * smooth else 1
    regime = None
    if set(CELL) <= set(table.columns):
        rewards = table[table.metric == "reward_mean"].sort_values(["loss", "max_new_tokens"], kind="stable")
        facets = rewards.assign(metric="reward: " + rewards.loss.astype(str) + ", "
                                + rewards.max_new_tokens.astype(str) + " tokens")
        figures = {"reward": reward_curves(facets, tuple(pd.unique(facets.metric)), smooth=smooth,
                                           title=f"ON/OFF {name}: reward per cell, mean over seeds")}
        if not done.empty:
            regime = regime_table(done, window)
            figures["regime_map"] = regime_map(regime)
    else:
        figures = {"reward": reward_curves(table, ("reward_mean",) + tuple(
            m for m in sorted(set(table.metric)) if m.startswith("accuracy_")), smooth=smooth,
            title=f"ON/OFF {name}: reward, mean over seeds"),
            "mismatch": mismatch_panels(table, smooth=smooth, title=f"ON/OFF {name}: mismatch and update health")}
    one_arm = _is_arm(cfg)
    dose = dose_response(done, window) if not done.empty and regime is None and not one_arm else None
    if dose is not None and dose.variant.str.startswith("noise=").any():
        figures["dose_response"] = dose_response_figure(dose)
        dose.to_csv(folder / "dose_response.csv", index=False)
    else:
        dose = None
    for fig_name, fig in figures.items():
        _save(fig, folder, fig_name, cfg)
    shown = [n for n in ("regime_map", "reward", "mismatch", "delta_histogram", "dose_response")
             if n in figures or (folder / f"{n}.png").exists()]
    if done.empty:
        (folder / "summary.md").write_text(unfinished_markdown(cfg, folder, shown, table))
        return
    if regime is not None:
        regime.to_csv(folder / "summary.csv", index=False)
        (folder / "summary.md").write_text(regime_markdown(cfg, folder, done, regime, shown, header, note))
        return
    summary = summarize(done, window)
    summary.to_csv(folder / "summary.csv", index=False)
    if one_arm:
        (folder / "summary.md").write_text(summary_markdown(cfg, folder, done, summary, dose, shown, header, note,
                                                             arm_verdict(folder, done, summary)))
        return
    (folder / "summary.md").write_text(summary_markdown(cfg, folder, done, summary, dose, shown, header, note))


def reissue(folder: str | Path, note: str, window: int = 10) -> None:
    """Rewrite a published folder's statistics (summary.md, summary.csv, figures) from its own files with the
    current code, keeping its title and facts lines (date, device, commits, runs) and adding `note`: how the
    published verdicts change when the statistics do."""
    folder = Path(folder)
    old = (folder / "summary.md").read_text().splitlines()
    # The title and the facts list; an earlier re-issue's note is replaced, so a second re-issue gives the same.
    header = [line for line in old[:old.index("## Verdict")] if line.startswith(("# ", "- "))] \
        if "## Verdict" in old else None
    write_report(folder, window, header=header or None, note=note)


def publish(out_dir: str | Path, dest: str | Path) -> Path:
    """Copy out_dir's report to dest/<date>_onoff-<preset>-<device>_<sha>/ (writing the report first), with its
    result.json, and regenerate dest's index (`workbench.records`)."""
    out = Path(out_dir)
    cfg = OnOffConfig(**read_config_file(out / "config.yaml", OnOffConfig))
    # A regime arm is a unit of the pre-registered map: its described final reward is the plan's endpoint.
    folder = report(out, window=PLAN_WINDOW if cfg.preset == "regime" else 10)
    calls = pd.read_csv(out / "invocations.csv")
    device = str(calls.device.iloc[-1])
    slug = (re.search(r"[A-Z]\d{2,4}", device) or re.search(r"\w+", device)).group(0).lower()
    sha = str(calls.git_sha.iloc[-1])[:7]
    date = datetime.date.today().isoformat()
    preset = cfg.preset or "custom"
    name = preset
    if len(cfg.arms) == 1:  # one arm of a cell: arms of one day and commit must not overwrite each other
        settings = recorded_settings(folder)
        preset = f"{preset}{ARM_SUFFIX}"
        arm = re.sub(r"[^A-Za-z0-9.-]", "", cfg.arms[0])
        name = f"{preset}-{arm}-L{settings['max_new_tokens']}-{settings['loss']}-s{seed_span(cfg.seeds)}"
    target = Path(dest) / f"{date}_onoff-{name}{'-smoke' if cfg.smoke else ''}-{slug}_{sha}"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target)
    write_record(target, _record(target, cfg, preset, device, sha, date))
    write_index(dest)
    return target


def _record(folder: Path, cfg: OnOffConfig, preset: str, device: str, sha: str, date: str) -> Record:
    """The published report's result.json: its summary.csv's endpoints per arm and summary.md's verdict."""
    text = (folder / "summary.md").read_text()
    verdict = re.search(r"\n## Verdict\n\n(.*?)(?:\n\n|\Z)", text, flags=re.S)
    summary = pd.read_csv(folder / "summary.csv") if (folder / "summary.csv").exists() else pd.DataFrame()
    figures = {f"{row.variant} / {column}": Figure(float(row[column]))
               for _, row in summary.iterrows() for column in COLUMNS
               if column in summary and np.isfinite(pd.to_numeric(row[column], errors="coerce"))}
    return Record(folder=folder.name, kind="onoff", question=text.splitlines()[0].lstrip("# ").strip() or folder.name,
                  figures=figures, device=device, commit=sha, date=date,
                  command=f"python -m workbench on-off --preset {cfg.preset or 'custom'}"
                          + (f" arms=[{cfg.arms[0]}]" if len(cfg.arms) == 1 else "") + " (settings in config.yaml)",
                  verdict=verdict.group(1).replace("\n", " ") if verdict else "see summary.md", preset=preset,
                  smoke=cfg.smoke)


ARM_SUFFIX = "-arm"
"""The suffix of a one-arm record's preset: no comparison, so no published result of its own."""
_FIGURE_ORDER = ("regime_map", "dose_response", "reward", "mismatch", "delta_histogram")


@dataclass(frozen=True)
class Published:
    """One published ON/OFF folder, as a notebook shows it beside a smoke run."""

    folder: Path
    """The folder in docs/results."""
    preset: str
    """The preset it ran (its record's)."""
    date: str
    """The publishing date (its record's)."""
    device: str
    """The device its runs ran on (invocations.csv, else its record's)."""
    label: str
    """"published, GPU, <device>, <date>": what a reader must see next to these numbers."""
    figures: tuple[Path, ...]
    """Its PNG figures, the regime map and the dose-response first."""
    markdown: str
    """summary.md under the label, without its list of figure links (the figures are shown instead)."""


def published_results(root: str | Path = "docs/results") -> list[Published]:
    """The newest published ON/OFF record of each preset in `root`'s index (a relative root is the project's), smoke
    and one-arm records left out, the regime map's first and then the newest first. A folder `publish` wrote is picked
    up through the index it regenerates."""
    newest: dict[str, Record] = {}
    for record in load_index(root):
        if (record.kind != "onoff" or record.smoke or record.preset.endswith(ARM_SUFFIX)
                or not (project_path(root) / record.folder / "summary.md").exists()):
            continue
        if record.preset not in newest or (record.date, record.folder) > (newest[record.preset].date,
                                                                          newest[record.preset].folder):
            newest[record.preset] = record
    found = []
    for record in newest.values():
        folder = project_path(root) / record.folder
        calls = folder / "invocations.csv"
        devices = pd.read_csv(calls).device.astype(str) if calls.exists() else pd.Series(dtype=str)
        device = devices.iloc[-1] if len(devices) else record.device
        label = published_label(device, record.date)
        text = (folder / "summary.md").read_text()
        text = re.sub(r"\n## Figures\n.*?(?=\n## |\Z)", "\n", text, flags=re.S)
        figures = tuple(folder / f"{n}.png" for n in _FIGURE_ORDER if (folder / f"{n}.png").exists())
        found.append(Published(folder, record.preset, record.date, device, label, figures,
                               f"**{label}** (`{folder.name}`)\n\n{text}"))
    return sorted(found, key=lambda p: (p.preset.startswith("regime"), p.date, p.folder.name), reverse=True)

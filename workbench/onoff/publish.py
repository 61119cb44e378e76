"""The experiment's report, drawn only from its folder: summary.md (the verdict, the dose-response slope, the
table of endpoints, the caveats), the figures as SVG and PNG, and the long metrics table, in out_dir/report/;
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
from .arms import get_arm
from .comparison_figures import dose_response_figure, regime_map
from .config import OnOffConfig
from .figures import delta_histogram, mismatch_panels, reward_curves
from .regime_plan import WINDOW as PLAN_WINDOW, recorded_settings
from .runner import POLICY_RECORD, collect, finished_runs, total_wall_s
from .stats import (CELL, dose_response, dose_sentence, dose_slope, final_reward_words, regime_table, summarize,
                    verdict)

# The endpoints a reader compares, in the summary's table: column -> (header, how to print).
_COLUMNS = {"runs": ("runs", "{:.0f}"), "steps": ("steps", "{:.0f}"), "final_reward": ("final reward", "ci"),
            "d_final_reward": ("vs {reference}", "ci"), "d_final_reward_p_holm": ("p (Holm)", "{:.3g}"),
            "auc": ("mean reward (AUC)", "ci"),
            "steps_to_threshold": ("steps to threshold", "{:.1f}"), "kl_mean": ("KL / token", "{:.3g}"),
            "max_abs_diff": ("max abs Δ log-prob", "{:.3g}"), "tokens_differing": ("tokens differing", "{:.0f}"),
            "ess_min": ("min ESS", "{:.3f}"), "clip_fraction": ("clip fraction", "{:.3f}"),
            "time_step_median": ("s / step", "{:.2f}")}


def _cell(row: pd.Series, name: str, how: str) -> str:
    value = row.get(name, np.nan)
    if not np.isfinite(value):
        return "–"
    if how != "ci":
        return how.format(value)
    lo, hi = row.get(f"{name}_lo", np.nan), row.get(f"{name}_hi", np.nan)
    return f"{value:.3f} [{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) else f"{value:.3f}"


def markdown_table(summary: pd.DataFrame) -> str:
    """The per-arm endpoints as a markdown table (means over seeds, [95% t-interval])."""
    cols = [c for c in _COLUMNS if c in summary]
    reference = summary.attrs.get("reference", "on")
    lines = ["| arm | " + " | ".join(_COLUMNS[c][0].format(reference=reference) for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for _, row in summary.iterrows():
        lines.append(f"| `{row.variant}` | " + " | ".join(_cell(row, c, _COLUMNS[c][1]) for c in cols) + " |")
    return "\n".join(lines)


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
        (folder / "summary.md").write_text(_unfinished_markdown(cfg, folder, shown, table))
        return
    if regime is not None:
        regime.to_csv(folder / "summary.csv", index=False)
        (folder / "summary.md").write_text(_regime_markdown(cfg, folder, done, regime, shown, header, note))
        return
    summary = summarize(done, window)
    summary.to_csv(folder / "summary.csv", index=False)
    if one_arm:
        (folder / "summary.md").write_text(_summary_markdown(cfg, folder, done, summary, dose, shown, header, note,
                                                             _arm_verdict(folder, done, summary)))
        return
    (folder / "summary.md").write_text(_summary_markdown(cfg, folder, done, summary, dose, shown, header, note))


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


def _figure_lines(figures, folder: Path) -> list[str]:
    svg = {name: f" ([SVG]({name}.svg))" if (folder / f"{name}.svg").exists() else "" for name in figures}
    return ["", "## Figures", ""] + [f"![{name}]({name}.png){svg[name]}" for name in figures]


def _unfinished_markdown(cfg: OnOffConfig, out: Path, figures, table: pd.DataFrame) -> str:
    """No finished run: where each run got to and what it showed there, described, with no endpoint or test."""
    runs = pd.read_csv(out / "runs.csv")
    settings = recorded_settings(out)
    title = (f"# ON/OFF experiment `{cfg.preset or 'custom'}`"
             + (f": arm `{cfg.arms[0]}` at {settings['max_new_tokens']} new tokens, loss `{settings['loss']}`, seeds "
                f"{_seed_span(cfg.seeds)} (no run finished)" if len(cfg.arms) == 1 else ""))
    cut = ", ".join(f"`{r.run}` at step {int(r.steps_done)} of {cfg.run.steps}" for r in runs.itertuples())
    wide = table.pivot_table(index=["variant", "seed", "step"], columns="metric", values="value").reset_index()
    rows = ["| run | steps | reward, last 20 steps reached | response length | KL / token | tokens differing | "
            "s / step (median) |", "|---|---|---|---|---|---|---|"]
    for (variant, seed), run in wide.groupby(["variant", "seed"]):
        last = run[run.step > run.step.max() - 20]
        rows.append(f"| `{variant}-seed{seed}` | {int(run.step.max())} | {last.reward_mean.mean():.3f} | "
                    f"{last.get('response_length', pd.Series(dtype=float)).mean():.0f} | "
                    f"{last.get('sampler_trainer_kl', pd.Series(dtype=float)).mean():.3g} | "
                    f"{run.get('parity_tokens_differing', pd.Series(dtype=float)).sum():.0f} | "
                    f"{run.get('time_step', pd.Series(dtype=float)).median():.2f} |")
    return "\n".join([title, "", "## Verdict", "",
                      (f"No run finished ({cut}; total wall time {total_wall_s(out) / 60:.1f} min): no endpoint and "
                       "nothing tested. The runs are published for their curves; the plan's endpoint needs runs "
                       "that reach its last step."), "",
                      "## Where each run got to (described, not tested)", "", *rows]
                     + _figure_lines(figures, out)) + "\n"


def _header(cfg: OnOffConfig, out: Path, done, summary) -> list[str]:
    calls = pd.read_csv(out / "invocations.csv") if (out / "invocations.csv").exists() else pd.DataFrame()
    devices = ", ".join(sorted(set(calls.device.astype(str)))) if "device" in calls else "unknown"
    shas = ", ".join(sorted(set(calls.git_sha.astype(str)))) if "git_sha" in calls else "unknown"
    finished = int(pd.read_csv(out / "runs.csv").finished.astype(bool).sum())
    run = cfg.run
    return [f"# ON/OFF experiment `{cfg.preset or 'custom'}`{' (smoke)' if cfg.smoke else ''}",
            f"- date {datetime.date.today().isoformat()}; device {devices}; git {shas}",
            (f"- {finished} finished runs: arms {', '.join(f'`{v}`' for v in summary.variant)} "
             f"x seeds {sorted(set(done.seed))}, {int(done.step.max())} steps each; total wall time "
             f"{total_wall_s(out) / 60:.1f} min over {len(calls)} call{'' if len(calls) == 1 else 's'}"),
            (f"- policy `{run.policy or 'self-trained ' + cfg.policy_size}`, task `{run.data.task}`, loss "
             f"`{run.objective.loss}`, {run.rollout.prompts_per_step} prompts x {run.rollout.group_size} samples x "
             f"{run.rollout.max_new_tokens} new tokens, lr {run.optim.lr:g}; settings in config.yaml")]


def _arm_verdict(folder: Path, done: pd.DataFrame, summary: pd.DataFrame) -> str:
    """The verdict of a one-arm record: what it holds, its own endpoints, and that it compares nothing."""
    row, settings = summary.iloc[0], recorded_settings(folder)
    seeds = ", ".join(str(s) for s in sorted(set(done.seed)))
    ci = f" (95% t-CI {row.final_reward_lo:.3g} to {row.final_reward_hi:.3g})" if np.isfinite(row.final_reward_lo) \
        else ""
    return (f"One arm published alone: `{row.variant}` at {settings['max_new_tokens']} new tokens, loss "
            f"`{settings['loss']}`, {row.runs} finished run{'' if row.runs == 1 else 's'} (seeds {seeds}) x "
            f"{row.steps} steps. It calls nothing: `python -m workbench regime-map` pairs it by seed with the other "
            f"arms of its (length, loss) from their records. "
            f"{final_reward_words(int(row.steps), summary.attrs['window'])} `{row.variant}`: final reward "
            f"{row.final_reward:.3g}{ci}; mean KL / token {row.kl_mean:.3g}; "
            f"{row.tokens_differing:.0f} tokens differed between sampler and trainer.")


def _summary_markdown(cfg: OnOffConfig, out: Path, done, summary, dose, figures, header=None, note="",
                      text: str = "") -> str:
    runs = pd.read_csv(out / "runs.csv")
    unfinished = runs[~runs.finished.astype(bool)]
    ref = summary.attrs["reference"]
    head = header or _header(cfg, out, done, summary)
    lines = [head[0], "", *head[1:], ""] + ([note, ""] if note else []) + ["## Verdict", "",
                                                                           text or verdict(summary), ""]
    if dose is not None:
        lines += ["## Dose-response", "", dose_sentence(dose_slope(dose)), ""]
    lines += ["## Endpoints", "",
              f"Means over seeds, [95% t-interval over seeds]; `vs {ref}`: the paired difference in final reward "
              f"[95% paired t-interval]; p (Holm): its exact sign-flip permutation p-value, Holm-adjusted over the "
              f"arms compared with `{ref}`. {final_reward_words(int(summary.steps.min()), summary.attrs['window'])} "
              + _threshold_text(summary), "", markdown_table(summary), "", "## Arms", ""]
    lines += [f"- `{v}`: {get_arm(v).description}" for v in summary.variant]
    lines += _figure_lines(figures, out)
    caveats = []
    if cfg.smoke:
        seeds = len(cfg.seeds)
        caveats.append(f"Smoke scale: the tiny self-trained policy, {cfg.run.steps} steps, {seeds} seed"
                       f"{'s' if seeds > 1 else ''}. This checks the pipeline; it is no result.")
    workers = int(cfg.workers)
    if workers > 1:
        caveats.append(f"Up to {workers} runs shared the device at once: seconds per step are not the speed of one "
                       "run alone.")
    if len(unfinished):
        cut = ", ".join(f"{r.run} at step {int(r.steps_done)}" for r in unfinished.itertuples())
        caveats.append(f"{len(unfinished)} run(s) have not finished ({cut}): they are in metrics.csv.gz and in the "
                       "curves up to that step, not in the endpoints.")
    if caveats:
        lines += ["", "## Caveats", ""] + [f"- {c}" for c in caveats]
    return "\n".join(lines) + "\n"


def _regime_markdown(cfg: OnOffConfig, out: Path, done, regime, figures, header=None, note="") -> str:
    arms = list(dict.fromkeys(done.variant))
    head = header or _header(cfg, out, done, pd.DataFrame({"variant": arms}))
    ref = regime.attrs["reference"]
    lines = [head[0], "", *head[1:], ""] + ([note, ""] if note else []) + ["## Verdict", "",
             (f"Per (generation length, loss) cell: final reward (the last {regime.attrs['window']} steps) arm - "
              f"`{ref}`, paired by seed, with its 95% paired t-interval and exact sign-flip permutation p-value, "
              f"Holm-adjusted over all {len(regime)} compared cells; a cell is called higher or lower only when that "
              "p is at most 0.05 and the interval excludes 0."), "",
             "| max new tokens | loss | arm | seeds | KL / token | SD of seq. log-ratio | clip fraction | min ESS | "
             f"final reward − {ref} [95% t-CI] | p | p (Holm) | verdict |", "|---" * 12 + "|"]
    numbers = (("kl_mean", "{:.3g}"), ("seq_logratio_sd", "{:.3g}"), ("clip_fraction", "{:.3f}"),
               ("ess_min", "{:.3f}"), ("d_final_reward", "ci"), ("d_final_reward_p", "{:.3g}"),
               ("d_final_reward_p_holm", "{:.3g}"))
    for _, r in regime.iterrows():
        lines.append(f"| {r.max_new_tokens} | {r.loss} | `{r.variant}` | {r.seeds} | "
                     + " | ".join(_cell(r, col, how) for col, how in numbers) + f" | {r.verdict} |")
    lines += ["", "## Arms", ""] + [f"- `{v}`: {get_arm(v).description}" for v in arms]
    lines += _figure_lines(figures, out)
    return "\n".join(lines) + "\n"


def _threshold_text(summary: pd.DataFrame) -> str:
    threshold, ref = summary.attrs.get("threshold", np.nan), summary.attrs.get("reference", "on")
    if not np.isfinite(threshold):
        return f"Steps to threshold: none (no `{ref}` arm to set it)."
    return (f"Steps to threshold: the first step whose trailing mean reward reaches {threshold:.3g} (halfway from "
            f"`{ref}`'s start to its end), over the runs that reach it.")


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
        name = f"{preset}-{re.sub(r'[^A-Za-z0-9.-]', '', cfg.arms[0])}-L{settings['max_new_tokens']}-{settings['loss']}" \
               f"-s{_seed_span(cfg.seeds)}"
    target = Path(dest) / f"{date}_onoff-{name}{'-smoke' if cfg.smoke else ''}-{slug}_{sha}"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(folder, target)
    write_record(target, _record(target, cfg, preset, device, sha, date))
    write_index(dest)
    return target


def _seed_span(seeds) -> str:
    """'0-7' for consecutive seeds, else '0.2.5': an arm may come in parts (seeds 0-3 in one GPU hold, 4-7 in the
    next), each its own record."""
    seeds = sorted(int(s) for s in seeds)
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    return ".".join(map(str, seeds))


def _record(folder: Path, cfg: OnOffConfig, preset: str, device: str, sha: str, date: str) -> Record:
    """The published report's result.json: its summary.csv's endpoints per arm and summary.md's verdict."""
    text = (folder / "summary.md").read_text()
    verdict = re.search(r"\n## Verdict\n\n(.*?)(?:\n\n|\Z)", text, flags=re.S)
    summary = pd.read_csv(folder / "summary.csv") if (folder / "summary.csv").exists() else pd.DataFrame()
    figures = {f"{row.variant} / {column}": Figure(float(row[column]))
               for _, row in summary.iterrows() for column in _COLUMNS
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

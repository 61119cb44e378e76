"""The words of an ON/OFF report (`publish.write_report`): summary.md's title and facts, its verdict, the table of
endpoints, the caveats, and the regime and one-arm variants, each from the experiment's folder and its tables."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from .arms import get_arm
from .config import OnOffConfig
from .regime_plan import recorded_settings
from .runner import total_wall_s
from .stats import dose_sentence, dose_slope, final_reward_words, verdict

# The endpoints a reader compares, in the summary's table: column -> (header, how to print).
COLUMNS = {"runs": ("runs", "{:.0f}"), "steps": ("steps", "{:.0f}"), "final_reward": ("final reward", "ci"),
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
    cols = [c for c in COLUMNS if c in summary]
    reference = summary.attrs.get("reference", "on")
    lines = ["| arm | " + " | ".join(COLUMNS[c][0].format(reference=reference) for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for _, row in summary.iterrows():
        lines.append(f"| `{row.variant}` | " + " | ".join(_cell(row, c, COLUMNS[c][1]) for c in cols) + " |")
    return "\n".join(lines)


def _figure_lines(figures, folder: Path) -> list[str]:
    svg = {name: f" ([SVG]({name}.svg))" if (folder / f"{name}.svg").exists() else "" for name in figures}
    return ["", "## Figures", ""] + [f"![{name}]({name}.png){svg[name]}" for name in figures]


def unfinished_markdown(cfg: OnOffConfig, out: Path, figures, table: pd.DataFrame) -> str:
    """No finished run: where each run got to and what it showed there, described, with no endpoint or test."""
    runs = pd.read_csv(out / "runs.csv")
    settings = recorded_settings(out)
    title = (f"# ON/OFF experiment `{cfg.preset or 'custom'}`"
             + (f": arm `{cfg.arms[0]}` at {settings['max_new_tokens']} new tokens, loss `{settings['loss']}`, seeds "
                f"{seed_span(cfg.seeds)} (no run finished)" if len(cfg.arms) == 1 else ""))
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


def arm_verdict(folder: Path, done: pd.DataFrame, summary: pd.DataFrame) -> str:
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


def summary_markdown(cfg: OnOffConfig, out: Path, done, summary, dose, figures, header=None, note="",
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


def regime_markdown(cfg: OnOffConfig, out: Path, done, regime, figures, header=None, note="") -> str:
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


def seed_span(seeds) -> str:
    """'0-7' for consecutive seeds, else '0.2.5': an arm may come in parts (seeds 0-3 in one GPU hold, 4-7 in the
    next), each its own record."""
    seeds = sorted(int(s) for s in seeds)
    if seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
    return ".".join(map(str, seeds))

"""The pre-registered regime map as a record folder, built from the arm records (`onoff.publish` of one-arm
experiments) on any machine: `python -m workbench regime-map [arm folders...] --out <folder>`, or every arm record in
docs/results/index.json when none is named. The folder holds map.csv (`regime_plan.map_table`), arms.csv (the arm
records it read), superseded.csv (cut copies of runs that another record finished), the figures
(`comparison_figures.plan_map`, `plan_mismatch`, `plan_curves`), summary.md, README.md and result.json; the records'
index is regenerated where the folder is one of them."""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from ..env import git_sha
from ..plots import save_figure
from ..records import Figure, Record, load_index, write_index, write_record
from ..tables import project_path
from .comparison_figures import plan_curves, plan_map, plan_mismatch
from .publish import ARM_SUFFIX
from .paired import ALPHA
from .regime_plan import (FAMILIES, MISMATCH, PLAN, POWER, SEEDS, STEPS, WINDOW, RegimeMapConfig, assemble,
                          map_table)


GRID = ["name", "family", "max_new_tokens", "loss", "arm", "on_seeds", "dose_seeds", "status"]
"""The columns of `map_table` that show the plan's grid: which cells, which arms' seeds are complete."""


def published_arms(root: str | Path = "docs/results", preset: str = "regime") -> list[Path]:
    """The folders of the one-arm records of `preset` in root's index (a relative root is the project's), oldest
    first; smoke records left out."""
    records = [r for r in load_index(root) if r.kind == "onoff" and not r.smoke and r.preset == preset + ARM_SUFFIX]
    return [project_path(root) / r.folder for r in sorted(records, key=lambda r: (r.date, r.folder))]


def map_message(table: pd.DataFrame, arms: int) -> str:
    """One line: how much of the plan the published arms cover."""
    tested = int(table.tested.sum())
    if not arms:
        return f"No arm of the regime map is published yet: none of its {len(table)} planned cells has a result."
    if not tested:
        return (f"No cell of the regime map is complete yet ({arms} arm record{'' if arms == 1 else 's'} published; "
                f"a cell needs `on` and its dose arm, seeds {SEEDS[0]}-{SEEDS[-1]}, {STEPS} steps): no result.")
    return f"{tested} of the {len(table)} planned cells are tested: " + ", ".join(
        f"{f} {table[table.family == f].family_in.iloc[0]}" for f in FAMILIES) + "."


def _g(x) -> str:
    return f"{x:#.3g}".rstrip(".") if np.isfinite(x) else "–"


def _markdown(table: pd.DataFrame, arms: pd.DataFrame, superseded: pd.DataFrame, figures: list[str],
              sha: str) -> str:
    tested = table[table.tested]
    lines = [f"# The regime map, as pre-registered (`{PLAN}`): {len(tested)} of {len(table)} planned cells tested", "",
             f"- computed at commit {sha} from {len(set(arms.source))} arm records; the arms ran on "
             f"{', '.join(sorted(set(arms.device)))} at commits {', '.join(sorted(set(arms.commit)))}",
             f"- endpoint: a run's mean reward over steps {STEPS - WINDOW + 1}-{STEPS}; dose - `on` paired by seed "
             f"({SEEDS[0]}-{SEEDS[-1]}); a cell is called only if its exact sign-flip p, adjusted within its family "
             f"(Holm over its planned cells once all are tested; until then Bonferroni over them, which Holm cannot "
             f"reverse), is <= {ALPHA:g} and its 95% paired t-interval excludes 0; "
             f"'detectable': the |difference| the test finds with {POWER:.0%} power from the cell's own SD (all "
             f"{len(SEEDS)} signs alike)",
             "", "## Verdict", ""]
    lines += [f"- {r.name} (`{r.arm}` x {r.loss}, {r.max_new_tokens} tokens, T x KL {_g(r.t_x_kl)}): dose - `on` "
              f"{_g(r.d)} [{_g(r.lo)}, {_g(r.hi)}], detectable {_g(r.detectable)}: {r.verdict}; described, not "
              f"tested: the trainer's entropy per token over the same steps, `on` {_g(r.on_entropy)}, dose "
              f"{_g(r.dose_entropy)} nats" for r in tested.itertuples()]
    bad = table[table.on_tokens_differing > 0]
    lines += [f"- WARNING: `on` of {r.name} is not bitwise ({r.on_tokens_differing:.0f} tokens differed)"
              for r in bad.itertuples()]
    lines += [f"- WARNING: `{r.variant}` seed {r.seed} at {r.max_new_tokens} tokens, {r.loss}, rerun whole in "
              f"{r.kept}, does not repeat the rewards of its cut copy in {r.dropped}: a run's computation depends "
              "on more than its seed and settings" for r in superseded[~superseded.rewards_agree].itertuples()]
    lines += ["", "## Cells", "", "| cell | family (tested) | tokens | loss | arm | status | "
              + " | ".join(MISMATCH.values())
              + " | dose − on [95% t-CI] | p | p (family: Holm; interim: Bonferroni) | detectable |",
              "|---" * (10 + len(MISMATCH)) + "|"]
    for r in table.itertuples():
        mism = " | ".join(_g(getattr(r, c)) for c in MISMATCH)
        d = f"{_g(r.d)} [{_g(r.lo)}, {_g(r.hi)}]" if r.tested else "–"
        lines.append(f"| {r.name} | {r.family} ({r.family_in}) | {r.max_new_tokens} | {r.loss} | `{r.arm}` | "
                     f"{r.status} | {mism} | {d} | {_g(r.p)} | {_g(r.p_holm)} | {_g(r.detectable)} |")
    lines += ["", "## Arm records", "", "| folder | tokens | loss | arm | seeds | device | commit | date |",
              "|---" * 8 + "|"]
    lines += [f"| [`{a.source}`](../{a.source}/) | {a.max_new_tokens} | {a.loss} | `{a.variant}` | "
              f"{', '.join(map(str, a.seeds))} | {a.device} | {a.commit} | {a.date} |" for a in arms.itertuples()]
    if len(superseded):
        lines += ["", "## Runs cut in one hold and finished in another", "",
                  "The finished copy is read; the cut copy stays published for its curve. 'Same rewards': the steps "
                  "both copies ran hold the same reward bits (expected where the trainer runs the `invariant` kernels; "
                  "the `standard` trainer of `off` and its kin does not repeat its updates bit for bit: the plan's "
                  "deviation of 2026-12-03).",
                  "",
                  "| tokens | loss | arm | seed | read from | left out (cut after step) | same rewards |",
                  "|---" * 7 + "|"]
        lines += [f"| {r.max_new_tokens} | {r.loss} | `{r.variant}` | {r.seed} | `{r.kept}` | `{r.dropped}` "
                  f"({r.steps_dropped}) | {'yes' if r.rewards_agree else 'NO'} |" for r in superseded.itertuples()]
    lines += ["", "## Figures", ""] + [f"![{n}]({n}.png) ([SVG]({n}.svg))" for n in figures]
    return "\n".join(lines) + "\n"


def _verdict(table: pd.DataFrame) -> str:
    tested = table[table.tested]
    called = [f"{r.name} {'higher' if r.lo > 0 else 'lower'}" for r in tested[tested.resolved].itertuples()]
    interim = [f for f in FAMILIES if tested[tested.family == f].interim.any()]
    return (f"{len(tested)} of {len(table)} planned cells tested ("
            + ", ".join(f"{f} {table[table.family == f].family_in.iloc[0]}" for f in FAMILIES) + "); "
            + (f"resolved against `on`: {', '.join(called)}" if called else "no cell resolved against `on`")
            + (f"; interim (Bonferroni over the planned cells until all are tested) in {', '.join(interim)}"
               if interim else "") + ".")


def publish_map(folders, cfg: RegimeMapConfig) -> Path:
    """Assemble the arm records `folders` (all of cfg.root's `<preset>-arm` records when empty), compute the plan's
    map and write its record folder (cfg.root's index regenerated when the folder is in it); returns it. ValueError
    where no planned cell is complete."""
    folders = [Path(f) for f in folders] or published_arms(cfg.root, cfg.preset)
    if not folders:
        raise ValueError(f"no arm record to build the map from (smoke records are left out): name arm folders, or "
                         f"publish arms (on-off --preset {cfg.preset} arms=[<arm>] publish={cfg.root})")
    long = assemble(folders)
    table = map_table(long)
    if not table.tested.any():
        started = [f"{r.name}: {r.status}" for r in table.itertuples() if r.status.count("not published") < 2]
        planned = {(r.max_new_tokens, r.loss, arm) for r in table.itertuples() for arm in (r.arm, "on")}
        unplanned = [f"`{a.variant}` at {a.max_new_tokens} tokens, {a.loss}" for a in long.attrs["arms"].itertuples()
                     if (a.max_new_tokens, a.loss, a.variant) not in planned]
        words = [map_message(table, len(folders)), "; ".join(started) + "." if started else "",
                 f"In no planned cell: {'; '.join(unplanned)}." if unplanned else ""]
        raise ValueError(" ".join(w for w in words if w))
    sha = git_sha()
    date = datetime.date.today().isoformat()
    out = Path(cfg.out) if cfg.out else project_path(cfg.root) / (
        f"{date}_regime-map-{int(table.tested.sum())}of{len(table)}_{sha[:7]}")
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "map.csv", index=False)
    arms = long.attrs["arms"]
    arms.to_csv(out / "arms.csv", index=False)
    figures = {"plan_map": plan_map(table), "plan_mismatch": plan_mismatch(table),
               "plan_curves": plan_curves(long, table)}
    for name, fig in figures.items():
        save_figure(fig, out, name)
    long.attrs["superseded"].to_csv(out / "superseded.csv", index=False)
    text = _markdown(table, arms, long.attrs["superseded"], list(figures), sha)
    (out / "summary.md").write_text(text)
    (out / "README.md").write_text(text)
    numbers = {f"map / {r.name} / {col}": Figure(float(getattr(r, col)))
               for r in table[table.tested].itertuples()
               for col in ("d", "lo", "hi", "p", "p_holm", "detectable", *MISMATCH)
               if np.isfinite(getattr(r, col))}
    write_record(out, Record(folder=out.name, kind="onoff", question=text.splitlines()[0].lstrip("# "),
                             figures=numbers, device=", ".join(sorted(set(arms.device))),
                             commit=", ".join(sorted(set(arms.commit))), date=date,
                             command="python -m workbench regime-map " + " ".join(
                                 f"docs/results/{f.name}" for f in folders) + f" --out docs/results/{out.name}",
                             verdict=_verdict(table),
                             preset=f"{cfg.preset}-map"))
    if out.parent.resolve() == project_path(cfg.root).resolve():  # a folder elsewhere is no record of root's
        write_index(cfg.root)
    return out

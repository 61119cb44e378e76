"""The regime map as its pre-registered plan defines it (docs/results/2026-12-02_regime-plan), computed from arms
published one at a time.

The plan fixes, before any run: the cells (one dose arm against `on` at one generation length and loss), their
families (Holm's correction runs within a family, over its cells), the endpoint (a run's mean reward over steps
281-300, the last 20 of 300), the seeds (0-7), alpha, and the T x KL boundaries its hypotheses predict. An arm (one
arm of one (length, loss), seeds 0-7, 300 steps) fits one GPU hold and is published as a record folder of its own
(`onoff.publish` of a one-arm experiment); `assemble` joins such folders into one long table, refusing arms whose
recorded settings differ in anything but the arm, and `map_table` gives the plan's numbers for every planned cell:
tested where both arms are complete, its status where not.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy import stats

from ..records import read_record
from .paired import ALPHA, LEVEL, compare_paired, smallest_p
from .stats import REFERENCE, reading


@dataclass(frozen=True)
class Cell:
    """One planned comparison: `arm` against `on` at one generation length and loss."""

    name: str
    """The plan's label (P1, S3, ...; G1-G8, the several-GPU family, are numbered here: the plan lists them)."""
    family: str
    """The family whose cells Holm's correction runs over."""
    max_new_tokens: int
    """The generation length (max new tokens)."""
    loss: str
    """The loss."""
    arm: str
    """The dose arm; `on` of the same length and loss is its control."""


@dataclass(frozen=True)
class RegimeMapConfig:
    """The `regime-map` command's settings (`regime_record.publish_map`)."""

    out: str = ""
    """The map record's folder ('': <root>/<date>_regime-map-<tested>of<planned>_<commit>)."""
    root: str = "docs/results"
    """The records' folder: where the arm records are found when none is named."""
    preset: str = "regime"
    """The preset the arms ran (their records' preset is <preset>-arm)."""


PLAN = "2026-12-02_regime-plan"
"""The plan's record folder under docs/results."""
STEPS = 300
"""Steps of every run."""
SEEDS = tuple(range(8))
"""The seeds of every arm; a cell pairs its two arms by seed."""
WINDOW = 20
"""The endpoint: a run's mean reward over its last WINDOW steps (281-300)."""
BOUNDARIES = {"H1": 3.0, "literature": 20.0}
"""T x KL where a summed sequence ratio starts to cost reward: H1's prediction, and the literature's (verl's clamp)."""
POWER = 0.8
"""The power the plan's detectable effect is stated at."""
CELLS = (
    Cell("P1", "primary", 1024, "blog", "noise=0.6"), Cell("P2", "primary", 1024, "blog", "off"),
    Cell("P3", "primary", 1024, "grpo", "off"), Cell("P4", "primary", 1024, "blog", "off-fp8"),
    Cell("P5", "primary", 1024, "grpo", "off-fp8"), Cell("P6", "primary", 1024, "grpo", "noise=0.6"),
    Cell("S1", "secondary", 256, "blog", "noise=0.3"), Cell("S2", "secondary", 512, "blog", "noise=0.3"),
    Cell("S3", "secondary", 1024, "blog", "noise=0.3"), Cell("S4", "secondary", 256, "blog", "off"),
    Cell("S5", "secondary", 512, "blog", "off"), Cell("S6", "secondary", 256, "grpo", "noise=0.6"),
    *(Cell(f"G{i}", "several GPUs", length, loss, arm) for i, (length, loss, arm) in
      enumerate(itertools.product((2048, 4096), ("blog", "grpo"), ("off", "off-fp8")), 1)),
)
"""Every planned cell, in the plan's order; `gspo` cells join the secondary family where run (`cells`)."""
FAMILIES = tuple(dict.fromkeys(c.family for c in CELLS))
IF_RUN = ("gspo", "secondary")
"""The plan's cells 'if run': any dose arm of this loss at any length, in this family (named Sg1, Sg2, ...)."""

MAP_METRICS = ("reward_mean", "response_length", "sampler_trainer_kl", "seq_logratio_sd", "token_ratio_outside_0.2",
               "seq_sum_ratio_outside_0.2", "is_ess", "parity_tokens_differing", "entropy")
"""The metrics the map reads (the long tables hold many more)."""
MISMATCH = {"kl_per_token": "KL / token", "t_x_kl": "T x KL", "seq_logratio_sd": "SD of the sequence log-ratio",
            "token_clip_share": "token ratios outside [0.8, 1.2]",
            "seq_clip_share": "summed sequence ratios outside [0.8, 1.2]", "ess": "ESS"}
"""The mismatch columns of `map_table` (means over steps and seeds of the dose runs) and their names."""
_METRIC_OF = {"kl_per_token": "sampler_trainer_kl", "seq_logratio_sd": "seq_logratio_sd",
              "token_clip_share": "token_ratio_outside_0.2", "seq_clip_share": "seq_sum_ratio_outside_0.2",
              "ess": "is_ess"}
_RUN_ONLY = frozenset({"preset", "arms", "seeds", "out_dir", "publish", "workers", "mps", "time_limit_min",
                       "keep_checkpoints", "checkpoint_every", "progress", "tensorboard", "device"})
"""Recorded settings that say how a call ran, not what its runs compute (the seeds are compared run by run, in the
tables: config.yaml holds the last call's)."""
_PER_CELL = frozenset({"max_new_tokens", "loss", "policy"})
"""Settings that name the cell (the policy is warm-started per length): equal within a cell, free across cells."""
KEY = ["max_new_tokens", "loss", "variant", "seed"]


def _policy_weights(folder: Path) -> str:
    """The sha256 of the arm's starting weights (the runner's starting_policy.json), or '' in a record without it."""
    path = folder / "starting_policy.json"
    return json.loads(path.read_text())["weights_sha256"] if path.exists() else ""


def recorded_settings(folder: Path) -> dict:
    """A published folder's config.yaml as {setting: value}, groups flattened to their settings' bare names (a
    dotted path where two groups share a name): so records written before and after a setting moved into a group
    still compare."""
    path = folder / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: an arm's record folder is what `on-off ... publish=` writes")
    flat, todo = {}, [("", yaml.safe_load(path.read_text()) or {})]
    while todo:
        prefix, values = todo.pop()
        for key, value in values.items():
            if isinstance(value, dict):
                todo.append((f"{prefix}{key}.", value))
            else:
                flat[prefix + key] = value
    bare = Counter(k.rsplit(".", 1)[-1] for k in flat)
    return {(k.rsplit(".", 1)[-1] if bare[k.rsplit(".", 1)[-1]] == 1 else k): v for k, v in flat.items()}


def _differences(a: dict, b: dict, free: frozenset) -> list[str]:
    return [f"{k} ({a[k]!r} here, {b[k]!r} there)" for k in sorted(set(a) & set(b) - free) if a[k] != b[k]]


def assemble(folders) -> pd.DataFrame:
    """The long table of the published arms in `folders` (record folders), joined by (max_new_tokens, loss, arm,
    seed): MAP_METRICS' rows with the cell's columns, the folder (`source`), whether the run `finished` and the steps
    it was set to run (`target_steps`). `attrs['arms']` lists the arms found. Raises ValueError, in one line, where
    two arms of a cell differ in a setting other than the arm (or two cells in one besides length, loss and policy),
    or started from other weights (the runner's starting_policy.json, where both records hold it), or where two
    folders hold the same run and not exactly one of them finished it (or one name). A run cut short in one folder
    and finished in another is read from the latter (`_supersede`; attrs['superseded'] lists such copies)."""
    folders = [Path(f) for f in folders]
    named = Counter(f.name for f in folders)
    if twice := [name for name, n in named.items() if n > 1]:
        raise ValueError(f"{twice[0]} is named {named[twice[0]]} times: name each arm record once")
    parts, arms, first, cells, starts = [], [], None, {}, {}
    for folder in folders:
        record = read_record(folder)
        settings = recorded_settings(folder)
        cell = (int(settings["max_new_tokens"]), str(settings["loss"]))
        for other, free in ((cells.get(cell), _RUN_ONLY), (first, _RUN_ONLY | _PER_CELL)):
            if other is not None and (diff := _differences(settings, other[1], free)):
                raise ValueError(f"refusing to join {folder.name} with {other[0].name}: "
                                 f"{'the same cell' if free == _RUN_ONLY else 'the plan'} "
                                 f"({cell[0]} tokens, {cell[1]}) differs in {'; '.join(diff)}; an "
                                 "arm may differ from the others only in its arm: leave one out or rerun it")
        weights = _policy_weights(folder)
        if cell in starts and weights and starts[cell][1] and weights != starts[cell][1]:
            raise ValueError(f"refusing to join {folder.name} with {starts[cell][0].name}: their starting policies "
                             f"({settings.get('policy')}) are other weights (sha256 {weights[:12]} vs "
                             f"{starts[cell][1][:12]}); warm-start once per length and start every arm from it")
        starts.setdefault(cell, (folder, weights))
        cells.setdefault(cell, (folder, settings))
        first = first or (folder, settings)
        table = pd.read_csv(folder / "metrics.csv.gz")
        for name, value in zip(("max_new_tokens", "loss"), cell):
            if name in table and (table[name] != value).any():
                raise ValueError(f"{folder.name}: its metrics hold {name} other than config.yaml's {value}: not one "
                                 "arm's record")
        runs = pd.read_csv(folder / "runs.csv")
        table = table[table.metric.isin(MAP_METRICS)].assign(max_new_tokens=cell[0], loss=cell[1],
                                                             source=folder.name)
        finished = runs.set_index(["variant", "seed"]).finished.astype(bool)
        table["finished"] = finished.reindex(pd.MultiIndex.from_frame(table[["variant", "seed"]])).fillna(False)\
            .to_numpy(dtype=bool)
        table["target_steps"] = int(settings["steps"])
        parts.append(table[["step", "metric", "value", *KEY, "source", "finished", "target_steps"]])
        arms += [{"source": folder.name, "max_new_tokens": cell[0], "loss": cell[1], "variant": v,
                  "seeds": tuple(sorted(int(s) for s in runs[runs.variant == v].seed)), "device": record.device,
                  "commit": record.commit, "date": record.date} for v in pd.unique(runs.variant)]
    long = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(
        columns=["step", "metric", "value", *KEY, "source", "finished", "target_steps"])
    long, superseded = _supersede(long)
    long.attrs["arms"] = pd.DataFrame(arms, columns=["source", "max_new_tokens", "loss", "variant", "seeds",
                                                     "device", "commit", "date"])
    long.attrs["superseded"] = superseded
    return long


SUPERSEDED = [*KEY, "kept", "dropped", "steps_dropped", "rewards_agree"]
"""The columns of assemble's attrs['superseded']: a cut copy of a run left out for the copy that finished."""


def _supersede(long: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`long` with one folder per run, and the copies left out (SUPERSEDED). A run cut short in one hold is rerun
    whole in a later one from the same starting weights (assemble checks the digests), so where exactly one copy of
    a run finished, it stands in for the cut copies; `rewards_agree` says whether the steps they share hold the
    same reward bits, as a run that depends on its seed and settings alone must where its trainer runs the
    `invariant` kernels (the `standard` trainer of `off` and its kin does not repeat its updates bit for bit: the
    plan's deviation of 2026-12-03). Two finished copies, or none, stay an error: which one the map read would be
    a choice."""
    sources = long.groupby(KEY).source.nunique()
    dropped, rows = set(), []
    for key in sources[sources > 1].index:
        length, loss, arm, seed = key
        run = long.set_index(KEY).loc[key]
        done = sorted(set(run[run.finished.astype(bool)].source))
        if len(done) != 1:
            raise ValueError(f"the run `{arm}` seed {seed} at {length} tokens, {loss}, is in "
                             f"{'two' if len(set(run.source)) == 2 else 'several'} folders "
                             f"({', '.join(sorted(set(run.source)))}) and {len(done) or 'none'} of them finished "
                             f"it: name one of them")
        rewards = run[run.metric == "reward_mean"].pivot_table(index="step", columns="source", values="value")
        for other in sorted(set(run.source) - set(done)):
            shared = rewards[[done[0], other]].dropna()
            rows.append((*key, done[0], other, int(run[run.source == other].step.max()),
                         bool(len(shared)) and bool((shared[done[0]] == shared[other]).all())))
            dropped.add((*key, other))
    keep = ~pd.MultiIndex.from_frame(long[[*KEY, "source"]]).isin(list(dropped))
    return long[keep].reset_index(drop=True), pd.DataFrame(rows, columns=SUPERSEDED)


def run_table(long: pd.DataFrame) -> pd.DataFrame:
    """One row per run: `complete` (finished at STEPS steps, the plan's length), `final_reward` (mean reward over
    steps STEPS - WINDOW + 1 to STEPS), `final_entropy` (the trainer's entropy per token over the same steps, nats:
    described beside the endpoint, not in the plan), and per MISMATCH column its mean over the run's steps;
    `t_x_kl` is the mean over steps of that step's mean completion length x its KL per token."""
    wide = long.pivot_table(index=[*KEY, "step"], columns="metric", values="value", aggfunc="mean")
    wide = wide.reindex(columns=list(MAP_METRICS))
    step = wide.index.get_level_values("step")
    last = (step > STEPS - WINDOW) & (step <= STEPS)
    runs = pd.DataFrame({"steps": pd.Series(step, index=wide.index).groupby(KEY).max(),
                         "final_reward": wide.reward_mean.where(last).groupby(KEY).mean(),
                         "final_entropy": wide.entropy.where(last).groupby(KEY).mean(),
                         "t_x_kl": (wide.response_length * wide.sampler_trainer_kl).groupby(KEY).mean(),
                         **{col: wide[metric].groupby(KEY).mean() for col, metric in _METRIC_OF.items()},
                         "tokens_differing": wide.parity_tokens_differing.groupby(KEY).sum(min_count=1)})
    meta = long.groupby(KEY)[["finished", "target_steps"]].first()
    runs = runs.join(meta)
    runs["complete"] = runs.finished.astype(bool) & (runs.steps == STEPS) & (runs.target_steps == STEPS)
    return runs.reset_index()


def detectable_effect(diffs) -> float:
    """The smallest |mean difference| the plan's test detects with power POWER: n seeds resolve a cell only when
    all n differences share a sign, so P(sign)^n >= POWER, i.e. an effect of norm.ppf(POWER^(1/n)) SDs of the
    paired differences (1.92 at n = 8, the plan's ~1.9), times their sample SD."""
    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    return float(stats.norm.ppf(POWER ** (1 / len(d))) * d.std(ddof=1)) if len(d) > 1 else np.nan


def _seeds_words(seeds) -> str:
    seeds = sorted(seeds)
    return "none" if not seeds else (f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1))
                                     else ",".join(map(str, seeds)))


def _status(arm: str, runs: pd.DataFrame) -> str:
    if runs.empty:
        return f"`{arm}` not published"
    done = set(runs[runs.complete].seed)
    if set(SEEDS) <= done:
        return ""
    return (f"`{arm}`: {len(done & set(SEEDS))} of {len(SEEDS)} seeds complete ({_seeds_words(done & set(SEEDS))}; "
            f"complete: finished at {STEPS} steps), seeds published {_seeds_words(runs.seed)}")


def cells(runs: pd.DataFrame) -> tuple[Cell, ...]:
    """CELLS, and the cells 'if run' (IF_RUN) that `runs` (`run_table`) hold a dose arm of, by length and arm."""
    loss, family = IF_RUN
    found = runs[(runs.loss == loss) & (runs.variant != REFERENCE)]
    extra = sorted(set(zip(found.max_new_tokens.astype(int), found.variant)))
    return CELLS + tuple(Cell(f"Sg{i}", family, length, loss, arm) for i, (length, arm) in enumerate(extra, 1))


def map_table(long: pd.DataFrame) -> pd.DataFrame:
    """The plan's numbers, one row per planned cell (`cells`' order): `on_seeds`/`dose_seeds` (complete runs), its
    `status` ('complete' or what is missing), the dose runs' mismatch (MISMATCH, means over steps and seeds, of
    whatever dose runs are published), `on_entropy`/`dose_entropy` (the complete runs' mean `final_entropy`,
    described), and for a complete cell (`tested`) the paired difference dose - `on` of the
    endpoint (`d`, `lo`/`hi`: 95% t-interval, `p`: exact sign-flip, `p_holm`: adjusted within its family, by Holm
    over its m planned cells once all are complete, before that (`interim`) by Bonferroni over m, `floor`,
    `resolved` by the plan's rule, `sd` of the differences, `detectable`), `family_in` ('k of m' cells tested) and
    the `verdict` in words."""
    runs = run_table(long) if len(long) else pd.DataFrame(
        {c: pd.Series(dtype=bool if c == "complete" else object if c in ("loss", "variant") else float)
         for c in [*KEY, "complete", "final_reward", "final_entropy", "tokens_differing", *MISMATCH]})

    def final(arm: pd.DataFrame) -> pd.Series:
        return arm[arm.complete].set_index("seed").final_reward.reindex(SEEDS)

    rows = []
    for cell in cells(runs):
        at = runs[(runs.max_new_tokens == cell.max_new_tokens) & (runs.loss == cell.loss)]
        on, dose = at[at.variant == REFERENCE], at[at.variant == cell.arm]
        missing = [s for s in (_status(REFERENCE, on), _status(cell.arm, dose)) if s]
        row = {**vars(cell), "on_seeds": _seeds_words(on[on.complete].seed),
               "dose_seeds": _seeds_words(dose[dose.complete].seed), "tested": not missing,
               "status": "complete" if not missing else "; ".join(missing),
               **{col: pd.to_numeric(dose[col], errors="coerce").mean() for col in MISMATCH},
               **{f"{name}_entropy": pd.to_numeric(arm[arm.complete].final_entropy, errors="coerce").mean()
                  for name, arm in (("on", on), ("dose", dose))},
               "on_tokens_differing": pd.to_numeric(on.tokens_differing, errors="coerce").sum(min_count=1)}
        paired = (final(dose) - final(on)).dropna()
        if not missing:
            row.update(on_reward=final(on).mean(), dose_reward=final(dose).mean(), diffs=paired.to_numpy(dtype=float))
        elif len(paired):  # described, never tested: the plan tests a cell at all its seeds
            row["status"] += (f"; so far (not tested) dose - `{REFERENCE}` by seed: "
                              + ", ".join(f"{seed}: {d:+.3g}" for seed, d in paired.items()))
        rows.append(row)
    out = pd.DataFrame(rows)
    for col in ("d", "lo", "hi", "p", "p_holm", "floor", "sd", "detectable", "on_reward", "dose_reward"):
        out[col] = out.get(col, np.nan)
    out["resolved"], out["family_in"], out["interim"], out["verdict"] = False, "", False, "not tested: " + out.status
    out["d_seeds"] = None
    for family in FAMILIES:
        planned = out.family == family
        tested = out.index[planned & out.tested]
        out.loc[planned, "family_in"] = f"{len(tested)} of {int(planned.sum())}"
        out.loc[planned, "interim"] = len(tested) < planned.sum()
        if not len(tested):
            continue
        diffs = np.stack(out.loc[tested, "diffs"].to_list())
        res, m = compare_paired(diffs), int(planned.sum())
        interim = len(tested) < m
        if interim:
            # Bonferroni over the planned family: a p at most alpha / m is rejected by Holm over all m cells whatever
            # the others' p, so no cell called now is uncalled when the family completes (Holm over the cells tested
            # so far could call one that the plan's analysis does not).
            res["p_holm"] = np.minimum(1.0, m * res["p"])
            res["floor"] = np.minimum(1.0, m * smallest_p(res["n"]))
            res["resolved"] = (res["floor"] <= ALPHA) & (res["p_holm"] <= ALPHA) & ((res["lo"] > 0) | (res["hi"] < 0))
        for key, col in (("mean", "d"), ("lo", "lo"), ("hi", "hi"), ("p", "p"), ("p_holm", "p_holm"),
                         ("floor", "floor"), ("resolved", "resolved")):
            out.loc[tested, col] = res[key]
        for i, d in zip(tested, diffs):
            out.at[i, "sd"], out.at[i, "detectable"] = float(np.std(d, ddof=1)), detectable_effect(d)
            out.at[i, "d_seeds"] = tuple(float(x) for x in d)
            r = out.loc[i]
            text = reading(len(d), r.d, r.lo, r.hi, r.p, r.p_holm, r.floor, bool(r.resolved), REFERENCE,
                           family=m, correction="Bonferroni" if interim else "Holm")
            out.at[i, "verdict"] = text + (f"; interim ({len(tested)} of the family's {m} planned cells tested): "
                                           f"Bonferroni over all {m}, which their Holm cannot reverse"
                                           if interim else "")
    out = out.drop(columns=["diffs"], errors="ignore")
    out["resolved"] = out.resolved.astype(bool)
    out.attrs.update(window=WINDOW, steps=STEPS, alpha=ALPHA, level=LEVEL, reference=REFERENCE)
    return out

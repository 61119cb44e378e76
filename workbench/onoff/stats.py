"""Statistics of an ON/OFF experiment, computed from the long metrics table its runs write.

A run is one (variant, seed). Its endpoints (start and final reward, the area under the reward curve, the
sizes of the sampler-trainer mismatch) are one number per run, and an arm is compared with the reference arm
`on` through differences PAIRED by seed: runs with the same seed share what the seed fixes (e.g. the prompt
order), so pairing takes that shared noise out of the comparison. Intervals are percentile bootstraps over
seeds: they assume no distribution shape, but are rough with few seeds (3 seeds have 10 distinct resamples).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .arms import NOISE_PREFIX, get_arm

REFERENCE = "on"
# Resamples are drawn in chunks of at most this many counts, so a long vector of values never needs an
# n x len(values) matrix at once.
_CHUNK = 1 << 22
# How an arm pools its runs' mismatch and update endpoints: each the way its name says.
_POOLED = {"kl_mean": "mean", "max_abs_diff": "max", "mean_abs_diff": "mean", "tokens_differing": "sum",
           "steps_with_differing_tokens": "sum", "ess_min": "min", "clip_fraction": "mean", "ratio_mean": "mean",
           "grad_norm_max": "max", "time_step_median": "median"}
_RUN_COLUMNS = ["variant", "seed", "steps", "window", "start_reward", "final_reward", "auc", "steps_to_threshold",
                *_POOLED]


def _bootstrap_means(values: np.ndarray, n: int, seed: int) -> np.ndarray:
    """[rows, k] values (NaN = missing) -> [n, rows]: each row's mean over its k columns resampled with replacement.

    One resample of the k column indices serves every row (a seed is resampled as a whole run), applied as
    counts (how often each column was drawn) times the values: a matrix product, not an [n, rows, k] gather.
    """
    k = values.shape[1]
    present = np.isfinite(values)
    filled, present = np.where(present, values, 0.0), present.astype(float)
    rng = np.random.default_rng(seed)
    out = np.empty((n, values.shape[0]))
    per_chunk = max(1, _CHUNK // k)
    for start in range(0, n, per_chunk):
        m = min(per_chunk, n - start)
        draws = rng.integers(0, k, size=(m, k)) + k * np.arange(m)[:, None]
        counts = np.bincount(draws.ravel(), minlength=m * k).reshape(m, k).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample of only missing values has no mean
            out[start:start + m] = (counts @ filled.T) / (counts @ present.T)
    return out


def _quantiles(level: float) -> list[float]:
    return [(1 - level) / 2, (1 + level) / 2]


def bootstrap_ci(values, level: float = 0.95, n: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the finite values; (nan, nan) with fewer than 2."""
    x = np.asarray(values, dtype=float).ravel()
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float("nan"), float("nan")
    lo, hi = np.quantile(_bootstrap_means(x[None, :], n, seed)[:, 0], _quantiles(level))
    return float(lo), float(hi)


def bootstrap_band(wide, level: float = 0.95, n: int = 10_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a [steps, seeds] array: the percentile bootstrap interval of the mean over seeds.

    Rows with fewer than 2 finite values get NaN (one seed has no spread to resample).
    """
    wide = np.asarray(wide, dtype=float)
    lo, hi = np.full(len(wide), np.nan), np.full(len(wide), np.nan)
    enough = np.isfinite(wide).sum(axis=1) >= 2
    if enough.any():
        means = _bootstrap_means(wide[enough], n, seed)
        quantile = np.nanquantile if np.isnan(means).any() else np.quantile  # the NaN-aware one is ~3x slower
        lo[enough], hi[enough] = quantile(means, _quantiles(level), axis=0)
    return lo, hi


def arm_order(variants, reference: str = REFERENCE) -> list[str]:
    """The arms in order of first appearance, the reference first when present."""
    arms = list(pd.unique(pd.Series(variants, dtype=object)))
    if reference in arms:
        arms.remove(reference)
        arms.insert(0, reference)
    return arms


def noise_sigma(variant: str) -> float:
    """The injected noise of a dose-response arm: sigma of `noise=<sigma>`, 0 for the reference `on`."""
    if variant != REFERENCE and not variant.startswith(NOISE_PREFIX):
        raise ValueError(f"{variant!r} is not a dose-response arm ('{REFERENCE}' or '{NOISE_PREFIX}<sigma>')")
    return get_arm(variant).sampler_noise


def _col(run: pd.DataFrame, name: str) -> pd.Series:
    # An older run, or an arm that does not log some metric, summarizes it as NaN instead of failing.
    return run[name] if name in run else pd.Series(np.nan, index=run.index)


def _one_run(run: pd.DataFrame, window: int, threshold: float) -> dict:
    """Endpoints of one run: a step-indexed (sorted) frame with one column per metric."""
    n = len(run)
    w = window if n >= 2 * window else max(1, n // 2)  # start and final windows must not overlap
    reward = _col(run, "reward_mean")
    # The full trailing window is required, so a lucky first step or two cannot count as reaching the threshold.
    moving = reward.rolling(w).mean()
    reached = moving.index[moving >= threshold]  # a NaN threshold is never reached
    tokens = _col(run, "parity_tokens_differing")
    return {
        "steps": int(run.index.max()),
        "window": w,
        "start_reward": reward.iloc[:w].mean(),
        "final_reward": reward.iloc[-w:].mean(),
        "auc": reward.mean(),
        "steps_to_threshold": float(reached[0]) if len(reached) else np.nan,
        "kl_mean": _col(run, "sampler_trainer_kl").mean(),
        "max_abs_diff": _col(run, "parity_max_abs_diff").max(),
        "mean_abs_diff": _col(run, "parity_mean_abs_diff").mean(),
        "tokens_differing": tokens.sum(min_count=1),
        "steps_with_differing_tokens": float((tokens > 0).sum()) if tokens.notna().any() else np.nan,
        "ess_min": _col(run, "is_ess").min(),
        "clip_fraction": (_col(run, "clip_low") + _col(run, "clip_high")).mean(),
        "ratio_mean": _col(run, "ratio_mean").mean(),
        "grad_norm_max": _col(run, "grad_norm").max(),
        # The first step includes compilation and warm-up, so it does not stand for a step's time.
        "time_step_median": _col(run, "time_step")[run.index > run.index.min()].median(),
    }


def run_endpoints(table: pd.DataFrame, window: int = 10, threshold: float | None = None) -> pd.DataFrame:
    """One row per (variant, seed) with its endpoints (see the module docstring and `summarize`).

    `start_reward`/`final_reward` are the mean reward_mean over the first/last `window` steps (half the run when
    it is shorter than two windows; the run's `window` column), `auc` the mean over all steps,
    `steps_to_threshold` the first step whose trailing average over that window reaches `threshold` (NaN when
    never, or with no threshold). A metric the table lacks gives NaN.
    """
    threshold = np.nan if threshold is None else threshold
    if table.empty:
        return pd.DataFrame(columns=_RUN_COLUMNS)
    wide = table.pivot_table(index=["variant", "seed", "step"], columns="metric", values="value", aggfunc="mean")
    rows = [{"variant": variant, "seed": seed, **_one_run(run.droplevel(["variant", "seed"]).sort_index(), window,
                                                          threshold)}
            for (variant, seed), run in wide.groupby(level=["variant", "seed"])]
    rank = {arm: i for i, arm in enumerate(arm_order(table.variant))}
    out = pd.DataFrame(rows, columns=_RUN_COLUMNS)
    return out.sort_values(["variant", "seed"], key=lambda c: c.map(rank) if c.name == "variant" else c,
                           ignore_index=True)


def _paired(arm: pd.Series, ref: pd.Series, name: str) -> dict:
    """Mean and bootstrap CI of arm - reference over the seeds both have (Series indexed by seed)."""
    diffs = (arm - ref.reindex(arm.index)).dropna()
    lo, hi = bootstrap_ci(diffs)
    return {f"d_{name}": diffs.mean() if len(diffs) else np.nan, f"d_{name}_lo": lo, f"d_{name}_hi": hi}


def summarize(table: pd.DataFrame, window: int = 10, threshold: float | None = None,
              reference: str = REFERENCE) -> pd.DataFrame:
    """One row per arm (the reference first): runs, steps, and the endpoints pooled over seeds.

    final_reward, auc and steps_to_threshold are means over seeds with a bootstrap CI (`_lo`, `_hi`);
    steps_to_threshold averages only the runs that reached it (`threshold_reached` counts them). Mismatch and
    update endpoints are pooled as their names say (means; tokens and steps with differing tokens summed;
    max |Δ| and the largest grad norm as max; ESS as min). `d_final_reward` and `d_auc` (with CIs) are the mean
    per-seed difference arm - reference over the seeds both have (`paired_seeds`); NaN for the reference.

    A threshold of None is halfway between the reference's mean start and final reward (NaN without a
    reference); the threshold used, the window and the reference are in `attrs`.
    """
    if threshold is None:
        ref = run_endpoints(table[table.variant == reference], window)
        threshold = (ref.start_reward.mean() + ref.final_reward.mean()) / 2 if len(ref) else np.nan
    runs = run_endpoints(table, window, threshold)
    ref = runs[runs.variant == reference].set_index("seed")
    rows = []
    for variant, arm in runs.groupby("variant", sort=False):
        row = {"variant": variant, "runs": len(arm), "steps": int(arm.steps.max()),
               "start_reward": arm.start_reward.mean()}
        for name in ("final_reward", "auc", "steps_to_threshold"):
            row[name] = arm[name].mean()
            row[f"{name}_lo"], row[f"{name}_hi"] = bootstrap_ci(arm[name])
        row["threshold_reached"] = int(arm.steps_to_threshold.notna().sum())
        for name, how in _POOLED.items():
            row[name] = arm[name].sum(min_count=1) if how == "sum" else arm[name].agg(how)
        by_seed, is_ref = arm.set_index("seed"), variant == reference
        shared = by_seed.index[:0] if is_ref else by_seed.index.intersection(ref.index)
        row["paired_seeds"] = np.nan if is_ref else len(shared)
        for name in ("final_reward", "auc"):
            row.update(_paired(by_seed.loc[shared, name], ref[name], name))
        rows.append(row)
    out = pd.DataFrame(rows)
    out.attrs.update(threshold=float(threshold), window=window, reference=reference)
    return out


def _g(x) -> str:
    """3 significant digits, trailing zeros kept (0.700, not 0.7: the digits shown are the precision claimed)."""
    return f"{x:#.3g}".rstrip(".") if np.isfinite(x) else "n/a"


def _parity_sentence(row: pd.Series, reference: str) -> str:
    tokens, size = row.tokens_differing, f"{row.runs} run{'' if row.runs == 1 else 's'} x {row.steps} steps"
    if not np.isfinite(tokens):
        return f"`{reference}`: no parity was recorded, so nothing shows that its sampler and trainer agree bitwise."
    if tokens == 0 and not row.max_abs_diff > 0:  # a NaN max: only the count was logged
        return f"`{reference}`: 0 differing tokens in {size} (sampler and trainer agree bitwise)."
    return (f"WARNING: `{reference}` is NOT bitwise: {tokens:.0f} tokens differed, in "
            f"{row.steps_with_differing_tokens:.0f} run-steps of {size} (max |Δ log-prob| {_g(row.max_abs_diff)}), "
            f"so it is no exact on-policy reference and the differences below are not measured against one.")


def _arm_sentence(row: pd.Series, ref: pd.Series | None, reference: str) -> str:
    ci = (f"95% CI {_g(row.final_reward_lo)} to {_g(row.final_reward_hi)}" if np.isfinite(row.final_reward_lo)
          else "no CI: fewer than 2 runs")
    text = f"`{row.variant}`: final reward {_g(row.final_reward)} ({ci})"
    if ref is None:
        text += f"; no `{reference}` arm to compare with"
    else:
        text += f" vs {_g(ref.final_reward)} for `{reference}`"
        d, lo, hi, pairs = row.d_final_reward, row.d_final_reward_lo, row.d_final_reward_hi, row.paired_seeds
        if not pairs or not np.isfinite(d):
            text += f"; no seed shared with `{reference}`, so no paired difference"
        elif not np.isfinite(lo):
            text += (f"; paired difference {_g(d)} from {pairs:.0f} seed{'' if pairs == 1 else 's'}: the CI needs >= 2 "
                     f"seeds, so nothing is resolved")
        else:
            if lo > 0 or hi < 0:
                reading = f"{'higher' if lo > 0 else 'lower'} than `{reference}` (the CI excludes 0)"
            else:
                reading = "no difference resolved (the CI contains 0)"
            text += f"; paired difference {_g(d)} (95% CI {_g(lo)} to {_g(hi)}, {pairs:.0f} seeds): {reading}"
    if np.isfinite(row.kl_mean) or np.isfinite(row.max_abs_diff):
        return text + f". Mismatch: mean KL {_g(row.kl_mean)}, max |Δ log-prob| {_g(row.max_abs_diff)}."
    return text + ". Mismatch: not recorded."


def verdict(summary: pd.DataFrame, reference: str = REFERENCE) -> str:
    """A short paragraph read off `summarize`'s numbers: the reference's parity, then per arm its final reward,
    the paired difference to the reference with its 95% CI, what that CI resolves, and the mismatch size."""
    rows = summary.set_index("variant", drop=False)
    ref = rows.loc[reference] if reference in rows.index else None
    window = summary.attrs.get("window")
    parts = [_parity_sentence(ref, reference) if ref is not None else f"No `{reference}` arm in this table."]
    if window is not None:
        parts.append(f"Final reward is the mean reward over each run's last {window} steps (half the run when "
                     f"shorter)" + (f"; differences are arm - `{reference}`, paired by seed." if ref is not None
                                    else "."))
    seeds = summary.runs.min() if len(summary) else 0
    if 2 <= seeds < 5:
        parts.append(f"With only {seeds} seeds in the smallest arm, bootstrap CIs are rough and tend to be too narrow.")
    parts += [_arm_sentence(row, ref, reference) for _, row in rows.iterrows() if row.variant != reference]
    return " ".join(parts)


def dose_response(table: pd.DataFrame, window: int = 10) -> pd.DataFrame:
    """One row per run of the `noise=<sigma>` arms and `on` (sigma 0): variant, seed, sigma, the measured mean
    KL(sampler || trainer), final_reward and auc; sorted by sigma, then seed."""
    arms = [v for v in pd.unique(table.variant) if v == REFERENCE or str(v).startswith(NOISE_PREFIX)]
    runs = run_endpoints(table[table.variant.isin(arms)], window)
    runs["sigma"] = runs.variant.map(noise_sigma).astype(float)
    out = runs[["variant", "seed", "sigma", "kl_mean", "final_reward", "auc"]]
    out = out.sort_values(["sigma", "seed"], kind="stable", ignore_index=True)
    out.attrs["window"] = window
    return out

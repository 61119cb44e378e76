"""The paired comparison of arms with the reference over seeds, with an error rate that holds at 3-8 seeds.

Each compared arm gives one difference per seed, arm - reference, paired by seed (runs with the same seed share
its prompt order and sampling seeds). Per arm:

- a paired t-interval of the mean difference (`scipy.stats.ttest_1samp` on the differences, i.e. `ttest_rel`);
- an exact sign-flip permutation p-value (`scipy.stats.permutation_test`, one sample, `permutation_type='samples'`:
  under "no effect" each difference is as likely positive as negative, so all 2^n sign patterns are equally
  likely). It is exact, needs no normality, and its smallest attainable two-sided value is 2 / 2^n;
- Holm's step-down correction of those p-values across the arms compared with the reference (the family).

**The rule.** An arm is *resolved* (higher or lower than the reference) when its Holm-adjusted permutation p-value
is at most `alpha` AND its t-interval excludes 0. The permutation test holds the error rate at `alpha` whatever the
differences' distribution; the t-interval only keeps a resolved arm's printed interval consistent with the call.
Where even the most extreme sign pattern cannot reach `alpha` (2 / 2^n > alpha, times the family size under Holm:
fewer than 6 seeds for one arm at 0.05), the arm is *not resolvable*: nothing these seeds could show would count.

A percentile bootstrap of 3 differences is their [min, max], so "its CI excludes 0" meant "all three have the same
sign": a 25% false-positive rate under no effect (tests/test_onoff_stats.py measures the rule above instead).
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy import stats

ALPHA = 0.05
"""The family-wise error rate of the verdict (two-sided)."""
LEVEL = 0.95
"""The confidence level of the t-intervals."""
_EXACT_UP_TO = 16
"""Seeds up to which the permutation test enumerates all 2^n sign patterns (2^16 = 65,536); above, it draws that
many at random."""


def _mean_stat(x, axis):
    return np.mean(x, axis=axis)


def sign_flip_p(diffs) -> np.ndarray:
    """[..., n] differences (NaN: missing) -> [...] two-sided exact sign-flip p-values of their mean.

    A missing difference is set to 0: flipping the sign of a 0 changes nothing, so each pattern of the other signs
    is merely counted 2^(missing) times and the p-value is the one over the present differences. Fewer than one
    present difference gives NaN.
    """
    d = np.asarray(diffs, dtype=float)
    present = np.isfinite(d).sum(axis=-1)
    out = np.full(d.shape[:-1], np.nan)
    if d.shape[-1] == 0 or not (present > 0).any():
        return out
    filled = np.where(np.isfinite(d), d, 0.0)
    if d.shape[-1] == 1:  # scipy wants two; an added 0 changes no p-value (above)
        filled = np.concatenate([filled, np.zeros_like(filled)], axis=-1)
    res = stats.permutation_test((filled,), _mean_stat, permutation_type="samples",
                                 vectorized=True, n_resamples=2 ** _EXACT_UP_TO, axis=-1, rng=0)
    return np.where(present > 0, res.pvalue, np.nan)


def t_interval(values, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
    """[..., n] values (NaN: missing) -> the t-interval of their mean, (lo, hi) each [...]; NaN with fewer than 2."""
    x = np.asarray(values, dtype=float)
    if x.shape[-1] < 2:
        nan = np.full(x.shape[:-1], np.nan)
        return nan, nan.copy()
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # rows with < 2 values: NaN, which is the answer
        policy = "omit" if np.isnan(x).any() else "propagate"
        ci = stats.ttest_1samp(x, 0.0, axis=-1, nan_policy=policy).confidence_interval(level)
        # Equal values have no spread: the interval of their mean is that value (scipy gives NaN).
        flat = (np.nanmax(x, axis=-1) == np.nanmin(x, axis=-1)) & (np.isfinite(x).sum(axis=-1) >= 2)
        mean = np.nanmean(np.where(flat[..., None], x, 0.0), axis=-1)
    lo, hi = np.asarray(ci.low, dtype=float), np.asarray(ci.high, dtype=float)
    return np.where(flat, mean, lo), np.where(flat, mean, hi)


def holm(p) -> np.ndarray:
    """Holm-adjusted p-values along the last axis (the family); NaN (an arm with no test) is left out of it.

    scipy.stats offers only false-discovery-rate control (`false_discovery_control`); Holm controls the family-wise
    rate, which a yes/no verdict per arm needs, and is four lines: sorted ascending, the i-th (from 0) of m is scaled
    by m - i, then made monotone.
    """
    p = np.asarray(p, dtype=float)
    m = np.isfinite(p).sum(axis=-1, keepdims=True)
    order = np.argsort(np.where(np.isfinite(p), p, np.inf), axis=-1)
    ranked = np.take_along_axis(p, order, axis=-1)
    scaled = np.minimum(1.0, (m - np.arange(p.shape[-1])) * ranked)
    adjusted = np.maximum.accumulate(np.where(np.isfinite(scaled), scaled, -np.inf), axis=-1)
    out = np.empty_like(p)
    np.put_along_axis(out, order, adjusted, axis=-1)
    return np.where(np.isfinite(p), out, np.nan)


def smallest_p(n) -> np.ndarray:
    """The smallest two-sided sign-flip p-value n differences can give: 2 / 2^n (1 for n = 0)."""
    return np.minimum(1.0, 2.0 ** (1 - np.asarray(n, dtype=float)))


def compare_paired(diffs, alpha: float = ALPHA, level: float = LEVEL) -> dict[str, np.ndarray]:
    """The verdict's numbers for [..., arms, seeds] paired differences arm - reference (NaN: a seed the pair lacks).

    The arms axis is the Holm family; leading axes are independent experiments (the calibration test runs
    thousands at once). Returns arrays of shape [..., arms]: `n` (paired seeds), `mean`, `lo`/`hi` (t-interval),
    `p` (permutation), `p_holm`, `floor` (the smallest `p_holm` these seed counts can reach), `resolvable`
    (floor <= alpha) and `resolved` (the module docstring's rule).
    """
    d = np.asarray(diffs, dtype=float)
    if d.ndim < 2:
        raise ValueError(f"compare_paired needs [..., arms, seeds] differences, got shape {d.shape}")
    n = np.isfinite(d).sum(axis=-1)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mean of no differences is NaN
        mean = np.nanmean(d, axis=-1)
    lo, hi = t_interval(d, level)
    p = sign_flip_p(d)
    p_holm = holm(p)
    # Holm multiplies the smallest p of the family by its size m, and no adjusted p is below the arm's own p.
    tested = np.isfinite(p)
    family = tested.sum(axis=-1, keepdims=True)
    best = np.min(np.where(tested, smallest_p(n), 1.0), axis=-1, keepdims=True)
    floor = np.where(tested, np.minimum(1.0, np.maximum(smallest_p(n), family * best)), np.nan)
    resolvable = floor <= alpha
    resolved = resolvable & (p_holm <= alpha) & ((lo > 0) | (hi < 0))
    return {"n": n, "mean": mean, "lo": lo, "hi": hi, "p": p, "p_holm": p_holm, "floor": floor,
            "resolvable": resolvable, "resolved": resolved}

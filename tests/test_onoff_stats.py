"""ON/OFF statistics and figures on synthetic tables: intervals, paired differences and the verdict they give,
endpoint windows and thresholds, missing metrics, the dose-response table, and that every figure draws."""

from __future__ import annotations

import io
import time

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from workbench.onoff.figures import delta_histogram, dose_response_figure, mismatch_panels, reward_curves
from workbench.onoff.publish import markdown_table
from workbench.onoff.stats import bootstrap_ci, dose_response, reference_arm, run_endpoints, summarize, verdict
from workbench.plots import save_figure


def _long(variant: str, seed: int, metrics: dict[str, np.ndarray]) -> pd.DataFrame:
    steps = len(next(iter(metrics.values())))
    return pd.concat([pd.DataFrame({"step": np.arange(1, steps + 1), "metric": name, "value": np.asarray(v, float),
                                    "variant": variant, "seed": seed}) for name, v in metrics.items()],
                     ignore_index=True)


def _experiment(rng, shifts: dict[str, float], seeds=range(5), steps=60, noise=0.01) -> pd.DataFrame:
    """Arms that follow one shared learning curve per seed, shifted by `shifts[arm]`, plus per-step noise; `on`
    has no mismatch, the other arms a small random one."""
    parts = []
    s = np.arange(1, steps + 1)
    for seed in seeds:
        base = 0.2 + 0.5 * (1 - np.exp(-s / 20)) + rng.normal(0, 0.05) + rng.normal(0, 0.02, steps)
        for arm, shift in shifts.items():
            on = arm in ("on", "on-vllm")
            kl = np.zeros(steps) if on else rng.uniform(1e-4, 1e-3, steps)
            parts.append(_long(arm, seed, {
                "reward_mean": base + shift + rng.normal(0, noise, steps),
                "sampler_trainer_kl": kl, "parity_max_abs_diff": 30 * kl, "parity_mean_abs_diff": 3 * kl,
                "parity_tokens_differing": np.zeros(steps) if on else rng.integers(1, 50, steps),
                "is_ess": 1 - kl, "ratio_mean": 1 + kl, "clip_low": kl, "clip_high": kl,
                "grad_norm": rng.uniform(0.5, 2, steps), "time_step": rng.uniform(1, 2, steps)}))
    return pd.concat(parts, ignore_index=True)


def test_bootstrap_ci_holds_the_mean_and_narrows_with_more_seeds():
    rng = np.random.default_rng(1)
    widths = {3: [], 30: []}
    for k in (3, 30):
        for _ in range(20):  # one draw of 3 can happen to lie close together; over 20 the trend is certain
            x = rng.normal(0.5, 0.1, k)
            lo, hi = bootstrap_ci(x, n=2000)
            assert lo <= x.mean() <= hi
            widths[k].append(hi - lo)
    assert np.mean(widths[30]) < np.mean(widths[3])
    assert bootstrap_ci([0.3, np.nan, 0.5]) == bootstrap_ci([0.3, 0.5]), "NaNs are dropped"
    assert all(np.isnan(bootstrap_ci([0.3, np.nan])))
    on = summarize(_experiment(rng, {"on": 0.0}, seeds=range(3))).iloc[0]
    assert on.final_reward_lo <= on.final_reward <= on.final_reward_hi and on.auc_lo <= on.auc <= on.auc_hi


def test_a_clear_effect_is_resolved_and_called_lower():
    summary = summarize(_experiment(np.random.default_rng(2), {"on": 0.0, "off": -0.2}))
    assert list(summary.variant) == ["on", "off"] and summary.runs.tolist() == [5, 5]
    off = summary.set_index("variant").loc["off"]
    assert off.d_final_reward == pytest.approx(-0.2, abs=0.02) and off.d_final_reward_hi < 0
    assert off.d_auc_hi < 0 and off.paired_seeds == 5 and off.kl_mean > 0 and off.tokens_differing > 0
    assert np.isnan(summary.d_final_reward.iloc[0]), "the reference has no difference to itself"
    text = verdict(summary)
    assert text.startswith("`on`: 0 differing tokens in 5 runs x 60 steps")
    assert "lower than `on` (the CI excludes 0)" in text


def test_a_null_is_not_resolved():
    table = _experiment(np.random.default_rng(3), {"off": 0.0, "on": 0.0})
    lonely = _experiment(np.random.default_rng(4), {"off-tis": 0.0}, seeds=(7, 8))
    summary = summarize(pd.concat([table, lonely]))
    assert summary.variant.iloc[0] == "on", "the reference comes first"
    off = summary.set_index("variant").loc["off"]
    assert off.d_final_reward_lo <= 0 <= off.d_final_reward_hi
    text = verdict(summary)
    assert "`off`: final reward" in text and "no difference resolved (the CI contains 0)" in text
    tis = summary.set_index("variant").loc["off-tis"]
    assert tis.paired_seeds == 0 and np.isnan(tis.d_final_reward) and "no seed shared with `on`" in text
    one_seed = verdict(summarize(table[table.seed == 0]))
    assert "the CI needs >= 2 seeds" in one_seed


def test_the_vllm_arms_alone_are_compared_with_on_vllm():
    table = _experiment(np.random.default_rng(6), {"off-vllm": -0.2, "on-vllm": 0.0}, seeds=(0, 1, 2))
    assert reference_arm(table.variant) == "on-vllm" and reference_arm(["on", "on-vllm", "off"]) == "on"
    summary = summarize(table)
    assert list(summary.variant) == ["on-vllm", "off-vllm"], "the reference comes first"
    off = summary.set_index("variant").loc["off-vllm"]
    assert off.paired_seeds == 3 and off.d_final_reward == pytest.approx(-0.2, abs=0.03)
    text = verdict(summary)
    assert text.startswith("`on-vllm`: 0 differing tokens in 3 runs") and "lower than `on-vllm`" in text
    assert "| vs on-vllm |" in markdown_table(summary)


def test_the_verdict_warns_when_the_reference_is_not_bitwise():
    table = _experiment(np.random.default_rng(5), {"on": 0.0, "off": 0.0}, seeds=(0, 1))
    table.loc[(table.variant == "on") & (table.metric == "parity_tokens_differing") & (table.step == 3), "value"] = 4
    text = verdict(summarize(table))
    assert text.startswith("WARNING: `on` is NOT bitwise: 8 tokens differed, in 2 run-steps")


def test_threshold_on_a_ramp():
    steps = np.arange(1, 101)
    table = pd.concat([_long("on", 0, {"reward_mean": steps / 100}), _long("off", 0, {"reward_mean": steps / 200})])
    runs = run_endpoints(table, window=10, threshold=0.5).set_index("variant")
    # The trailing 10-step average at step s is (s - 4.5) / 100: first >= 0.5 at step 55.
    assert runs.loc["on", "steps_to_threshold"] == 55 and np.isnan(runs.loc["off", "steps_to_threshold"])
    on = runs.loc["on"]
    assert (on.start_reward, on.final_reward, on.auc) == pytest.approx((0.055, 0.955, 0.505))
    assert np.isnan(run_endpoints(table).steps_to_threshold).all(), "no threshold, no step"
    summary = summarize(table, window=10)
    assert summary.attrs["threshold"] == pytest.approx(0.505) and summary.attrs["window"] == 10
    assert summary.steps_to_threshold.iloc[0] in (55, 56) and summary.threshold_reached.tolist() == [1, 0]
    assert np.isnan(summarize(table[table.variant == "off"]).attrs["threshold"]), "no reference, no threshold"


def test_short_runs_shrink_the_window():
    runs = run_endpoints(pd.concat([_long("on", 0, {"reward_mean": np.arange(1.0, 7.0)}),
                                    _long("on", 1, {"reward_mean": [2.0]})]), window=10)
    six, one = runs.iloc[0], runs.iloc[1]
    assert (six.window, six.start_reward, six.final_reward, six.auc, six.steps) == (3, 2.0, 5.0, 3.5, 6)
    assert (one.window, one.start_reward, one.final_reward) == (1, 2.0, 2.0)


def test_missing_metrics_give_nan():
    rewards_only = _long("on", 0, {"reward_mean": np.linspace(0, 1, 30)})
    run = run_endpoints(rewards_only).iloc[0]
    for name in ("kl_mean", "max_abs_diff", "tokens_differing", "steps_with_differing_tokens", "ess_min",
                 "clip_fraction", "grad_norm_max", "time_step_median"):
        assert np.isnan(run[name]), name
    text = verdict(summarize(pd.concat([rewards_only, _long("off", 0, {"reward_mean": np.linspace(0, 1, 30)})])))
    assert "no parity was recorded" in text and "Mismatch: not recorded" in text
    no_reward = run_endpoints(_long("off", 0, {"sampler_trainer_kl": np.full(5, 1e-3)})).iloc[0]
    assert np.isnan(no_reward.final_reward) and no_reward.kl_mean == pytest.approx(1e-3)


def test_dose_response_reads_sigma():
    rng = np.random.default_rng(6)
    table = _experiment(rng, {"on": 0.0, "noise=0.1": -0.1, "off": 0.0, "noise=0.01": -0.01}, seeds=(0, 1))
    dose = dose_response(table)
    assert dose.variant.tolist() == ["on", "on", "noise=0.01", "noise=0.01", "noise=0.1", "noise=0.1"]
    assert dose.sigma.tolist() == [0, 0, 0.01, 0.01, 0.1, 0.1]
    assert list(dose.columns) == ["variant", "seed", "sigma", "kl_mean", "final_reward", "auc"]
    assert (dose.kl_mean[dose.sigma == 0] == 0).all() and (dose.kl_mean[dose.sigma > 0] > 0).all()


def test_every_figure_draws_and_saves(tmp_path):
    rng = np.random.default_rng(7)
    table = _experiment(rng, {"on": 0.0, "off": -0.1, "off-recompute": 0.0, "noise=0.03": -0.05}, seeds=(0, 1, 2))
    deltas = {"on (SmolLM2-135M, invariant)": np.zeros(200),
              "off (SmolLM2-135M, standard)": np.where(rng.random(200) < 0.5, 0, rng.lognormal(-8, 1, 200))}
    figures = {"curves": reward_curves(table, metrics=("reward_mean", "entropy"), smooth=5, note="synthetic"),
               "one_seed": reward_curves(table[table.seed == 0]),
               "mismatch": mismatch_panels(table, smooth=3),
               "hist": delta_histogram(deltas),
               "hist_zeros": delta_histogram({"on": np.zeros(10)}),
               "dose": dose_response_figure(dose_response(table))}
    for name, fig in figures.items():
        assert isinstance(fig, Figure), name
        paths = save_figure(fig, tmp_path, name)
        assert [p.suffix for p in paths] == [".svg", ".png"] and all(p.stat().st_size > 0 for p in paths)
    with pytest.raises(ValueError, match="none of the metrics"):
        reward_curves(table, metrics=("accuracy",))


def test_mismatch_panels_with_an_all_zero_arm_on_log_axes():
    table = _experiment(np.random.default_rng(8), {"on": 0.0, "off": 0.0}, seeds=(0, 1))
    table = table[table.metric.isin(["parity_tokens_differing", "parity_max_abs_diff", "sampler_trainer_kl"])]
    for data in (table, table[table.variant == "on"]):
        fig = mismatch_panels(data)
        fig.savefig(io.BytesIO(), format="png", dpi=50)  # drawing is where a zero on a log axis would fail
        kl = next(ax for ax in fig.axes if ax.get_title() == "KL(sampler || trainer)")
        assert any("on: exactly 0 at every step" in t.get_text() for t in kl.texts)
        assert kl.get_yscale() == ("log" if data.variant.nunique() == 2 else "linear")


def test_reward_curves_are_fast_for_a_full_experiment():
    arms = {"on": 0.0, "off": -0.1, "off-recompute": 0.0, "off-tis": 0.0, "off-mis": 0.0, "off-vllm": 0.0,
            "on-vllm": 0.0}
    s = np.arange(1, 501)
    table = pd.concat([_long(arm, seed, {"reward_mean": s / 500 + shift + 0.01 * seed}) for arm, shift in arms.items()
                       for seed in range(5)])
    start = time.perf_counter()
    reward_curves(table, smooth=10)
    # 2 s is the target on an idle core; the margin is for a machine shared with other work.
    assert time.perf_counter() - start < 4

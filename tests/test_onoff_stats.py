"""ON/OFF statistics and figures on synthetic tables: the verdict's error rate and power on simulated experiments,
intervals, paired differences and the verdict they give, endpoint windows and thresholds, missing metrics, the
dose-response slope, the regime table, the published results, and that every figure draws and reads."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from matplotlib.legend import Legend

from workbench.onoff.comparison_figures import dose_response_figure, regime_map
from workbench.onoff.figures import bootstrap_band, delta_histogram, mismatch_panels, reward_curves
from workbench.onoff.paired import compare_paired, holm, sign_flip_p, t_interval
from workbench.config import write_config
from workbench.onoff.config import OnOffConfig
from workbench.onoff.publish import published_results, reissue, write_report
from workbench.onoff.report_text import markdown_table
from workbench.records import Record, write_index, write_record
from workbench.onoff.stats import (dose_response, dose_slope, reference_arm, regime_table, run_endpoints, summarize,
                                   verdict)
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


def _null_and_effect(seed: int, experiments: int, seeds: int, arms: int = 1, effect: float = 0.0):
    """[experiments, arms, seeds] paired differences of simulated experiments: per seed an effect shared by both
    arms (it cancels in the pairing, as a seed's prompt order does), per run its own noise, and `effect` in units
    of the paired differences' SD."""
    rng = np.random.default_rng(seed)
    shared = rng.normal(0, 3, (experiments, 1, seeds))
    arm = shared + rng.normal(0, 1, (experiments, arms, seeds)) + effect * np.sqrt(2)
    ref = shared + rng.normal(0, 1, (experiments, 1, seeds))
    return arm - ref


def test_the_verdict_holds_its_error_rate_with_few_seeds():
    """Under no effect, "resolved" at most 7% of 2,000 simulated experiments at 3, 5 and 8 seeds, one arm or five
    (Holm) compared with the reference. A percentile bootstrap of the differences gave 25% at 3 seeds."""
    for seeds in (3, 5, 8):
        for arms in (1, 5):
            seed = 100 * seeds + arms
            res = compare_paired(_null_and_effect(seed, 2000, seeds, arms))
            rate = res["resolved"].any(axis=-1).mean()  # family-wise: any arm of the experiment called
            assert rate <= 0.07, f"{seeds} seeds, {arms} arm(s): {rate:.1%} of null experiments resolved (seed {seed})"
            assert (res["resolvable"] == (seeds == 8)).all(), "8 seeds reach 0.05, even x 5 arms (5 x 2/2^8)"


def test_the_verdict_resolves_a_true_effect_at_eight_seeds():
    """A true effect of two SDs of the paired differences at 8 seeds is called, in the right direction, in at least
    80% of 2,000 simulated experiments."""
    for sign in (1, -1):
        seed = 7 + sign
        res = compare_paired(_null_and_effect(seed, 2000, 8, effect=2.0 * sign))
        called = res["resolved"] & (np.sign(res["mean"]) == sign)
        assert called.mean() >= 0.8, f"power {called.mean():.1%} (seed {seed})"


def test_paired_tests_against_hand_computed_values():
    d = np.array([-0.0190, -0.0557, -0.0189])  # blog-dose noise=0.3's published per-seed differences
    lo, hi = t_interval(d[None])
    assert (lo[0], hi[0]) == pytest.approx((-0.0839, 0.0215), abs=1e-4), "the paired t-interval contains 0"
    assert sign_flip_p(d[None])[0] == 0.25, "2 of the 8 sign patterns are as extreme"
    assert sign_flip_p(np.array([[1.0, 2, 3, 4, 5, 6]]))[0] == pytest.approx(2 / 64)
    assert sign_flip_p(np.array([[1.0, 2, np.nan]]))[0] == sign_flip_p(np.array([[1.0, 2]]))[0] == 0.5, \
        "a missing seed is left out, not counted as a 0"
    assert holm([0.01, 0.04, 0.03, np.nan]) == pytest.approx([0.03, 0.06, 0.06, np.nan], nan_ok=True)
    six = np.array([[1.0, 2, 3, 4, 5, 6]])
    assert compare_paired(six)["resolved"].all(), "6 seeds all one way: p = 2/64"
    two = compare_paired(np.concatenate([six, six]))
    assert two["floor"].tolist() == [2 * 2 / 64] * 2 and not two["resolvable"].any(), "Holm x 2 > 0.05"
    flat = t_interval(np.array([[0.5, 0.5, 0.5]]))
    assert (flat[0][0], flat[1][0]) == (0.5, 0.5), "no spread: the interval is the value"
    assert np.isnan(t_interval(np.array([[0.5]]))[0][0]) and np.isnan(sign_flip_p(np.full((1, 3), np.nan))[0])


def test_bootstrap_bands_hold_the_mean_and_survive_missing_seeds():
    rng = np.random.default_rng(13)
    wide = rng.normal(0.5, 0.1, (40, 5))
    wide[:5] = 0.7  # seeds that agree exactly: BCa is undefined there, the band is the value
    wide[30:, 4] = np.nan  # a run cut short at step 30
    wide[35:, 1:] = np.nan  # one seed left: no band
    lo, hi = bootstrap_band(wide)
    mean = np.nanmean(wide, axis=1)
    both = np.isfinite(lo)
    assert (both == (np.isfinite(wide).sum(axis=1) >= 2)).all(), "a band wherever two seeds are present (seed 13)"
    assert (lo[both] <= mean[both] + 1e-12).all() and (mean[both] <= hi[both] + 1e-12).all(), "(seed 13)"
    assert (lo[:5] == 0.7).all() and (hi[:5] == 0.7).all()
    assert np.mean(hi[5:30] - lo[5:30]) < 2 * 0.1, "the mean's band is narrower than two seed SDs (seed 13)"


def test_a_clear_effect_is_resolved_and_called_lower():
    summary = summarize(_experiment(np.random.default_rng(2), {"on": 0.0, "off": -0.2}, seeds=range(8)))
    assert list(summary.variant) == ["on", "off"] and summary.runs.tolist() == [8, 8]
    off = summary.set_index("variant").loc["off"]
    assert off.d_final_reward == pytest.approx(-0.2, abs=0.02) and off.d_final_reward_hi < 0
    assert off.d_auc_hi < 0 and off.paired_seeds == 8 and off.kl_mean > 0 and off.tokens_differing > 0
    assert off.d_final_reward_p == pytest.approx(2 / 256) and off.d_final_reward_resolved
    assert np.isnan(summary.d_final_reward.iloc[0]), "the reference has no difference to itself"
    text = verdict(summary)
    assert text.startswith("`on`: 0 differing tokens in 8 runs x 60 steps")
    assert "lower than `on` (permutation p 0.00781 <= 0.05; the t-interval excludes 0)" in text


def test_the_report_uses_the_calibrated_comparison():
    """summarize's numbers are compare_paired's on the runs' per-seed differences, Holm over the compared arms."""
    table = _experiment(np.random.default_rng(9), {"on": 0.0, "off": -0.05, "off-tis": 0.0}, seeds=range(6))
    summary = summarize(table).set_index("variant")
    runs = run_endpoints(table).pivot_table(index="variant", columns="seed", values="final_reward")
    diffs = runs.loc[["off", "off-tis"]].to_numpy() - runs.loc[["on"]].to_numpy()
    res = compare_paired(diffs)
    for key, col in (("mean", ""), ("lo", "_lo"), ("hi", "_hi"), ("p", "_p"), ("p_holm", "_p_holm")):
        assert summary.loc[["off", "off-tis"], f"d_final_reward{col}"].tolist() == pytest.approx(res[key]), key
    assert summary.loc["off", "d_final_reward_seeds"] == pytest.approx(tuple(diffs[0]))


def test_a_null_is_not_resolved_and_few_seeds_are_not_resolvable():
    table = _experiment(np.random.default_rng(3), {"off": 0.0, "on": 0.0}, seeds=range(8))
    lonely = _experiment(np.random.default_rng(4), {"off-tis": 0.0}, seeds=(17, 18))
    summary = summarize(pd.concat([table, lonely]))
    assert summary.variant.iloc[0] == "on", "the reference comes first"
    off = summary.set_index("variant").loc["off"]
    assert off.d_final_reward_lo <= 0 <= off.d_final_reward_hi and not off.d_final_reward_resolved
    text = verdict(summary)
    assert "`off`: final reward" in text and "no difference resolved (permutation p" in text
    tis = summary.set_index("variant").loc["off-tis"]
    assert tis.paired_seeds == 0 and np.isnan(tis.d_final_reward) and "no seed shared with `on`" in text
    three = summarize(table[table.seed < 3])
    d = three.d_final_reward_seeds.iloc[1]
    text = verdict(three)
    assert "not resolvable with 3 seeds (the smallest attainable p is 2/2^3 = 0.250)" in text
    assert "per-seed differences " + ", ".join(f"{x:#.3g}".rstrip(".") for x in d) in text
    assert "not resolvable with 1 seed (" in verdict(summarize(table[table.seed == 0]))
    six = summarize(_experiment(np.random.default_rng(5), {"on": 0.0, "off": -0.3, "off-tis": -0.3, "off-mis": 0},
                                seeds=range(6)))
    assert "not resolvable with 6 seeds and 3 comparisons" in verdict(six), "Holm x 3 lifts 2/64 above 0.05"


def test_the_vllm_arms_alone_are_compared_with_on_vllm():
    table = _experiment(np.random.default_rng(6), {"off-vllm": -0.2, "on-vllm": 0.0}, seeds=range(6))
    assert reference_arm(table.variant) == "on-vllm" and reference_arm(["on", "on-vllm", "off"]) == "on"
    summary = summarize(table)
    assert list(summary.variant) == ["on-vllm", "off-vllm"], "the reference comes first"
    off = summary.set_index("variant").loc["off-vllm"]
    assert off.paired_seeds == 6 and off.d_final_reward == pytest.approx(-0.2, abs=0.03)
    text = verdict(summary)
    assert text.startswith("`on-vllm`: 0 differing tokens in 6 runs") and "lower than `on-vllm`" in text
    assert "| vs on-vllm | p (Holm) |" in markdown_table(summary)


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


def test_dose_slope_is_one_fit_over_the_noise_arms():
    rng = np.random.default_rng(10)
    kl = np.repeat([1e-4, 1e-3, 1e-2, 1e-1], 3)
    dose = pd.DataFrame({"variant": ["on"] * 3 + [f"noise={s}" for s in np.repeat([0.01, 0.03, 0.1, 0.3], 3)],
                         "kl_mean": np.r_[np.zeros(3), kl], "auc": 0.0,
                         "final_reward": np.r_[np.full(3, 9.0), 1 - 0.05 * np.log10(kl) + rng.normal(0, 0.01, 12)]})
    fit = dose_slope(dose)
    assert fit["runs"] == 12, "`on` (KL 0, reward 9 here) is left out of the log fit"
    assert fit["lo"] < -0.05 < fit["hi"] and fit["hi"] - fit["lo"] < 0.03 and fit["p"] < 1e-6, fit
    assert np.isnan(dose_slope(dose[dose.variant == "on"])["slope"])


def _regime_experiment(seed: int, seeds: int, effect_at_2048: float) -> pd.DataFrame:
    """on/off at three lengths x two losses; `off` loses `effect_at_2048` x length / 2048 of reward."""
    rng = np.random.default_rng(seed)
    parts = []
    for length in (256, 1024, 2048):
        for loss in ("grpo", "gspo"):
            shifts = {"on": 0.0, "off": -effect_at_2048 * length / 2048}
            cell = _experiment(rng, shifts, seeds=range(seeds), steps=20)
            extra = cell[cell.metric == "reward_mean"].assign(metric="seq_logratio_sd")
            extra["value"] = np.where(extra.variant == "on", 0.0, np.sqrt(length) / 30)
            parts.append(pd.concat([cell, extra]).assign(max_new_tokens=length, loss=loss))
    return pd.concat(parts, ignore_index=True)


def test_regime_table_per_cell_with_holm_over_the_map():
    table = _regime_experiment(11, seeds=8, effect_at_2048=0.3)
    cells = regime_table(table, window=5)
    assert len(cells) == 6 and set(cells.variant) == {"off"} and (cells.seeds == 8).all()
    assert list(cells.max_new_tokens) == [256, 256, 1024, 1024, 2048, 2048]
    assert (cells.seq_logratio_sd.diff().iloc[1::2] == 0).all() and cells.seq_logratio_sd.is_monotonic_increasing
    long = cells[cells.max_new_tokens == 2048]
    assert long.d_final_reward_resolved.all() and (long.d_final_reward < -0.25).all()
    assert long.verdict.str.startswith("lower than `on` (permutation p 0.00781, Holm-adjusted").all()
    assert (cells.d_final_reward_p_holm >= cells.d_final_reward_p).all() and (cells.ess_min <= 1).all()
    few = regime_table(_regime_experiment(12, seeds=3, effect_at_2048=0.3), window=5)
    assert few.verdict.str.startswith("not resolvable with 3 seeds").all() and not few.d_final_reward_resolved.any()
    fig = regime_map(cells)
    fig.savefig(io.BytesIO(), format="png", dpi=50)
    assert [ax.get_title() for ax in fig.axes] == ["final reward − on (95% paired t-CI)",
                                                    "KL(sampler || trainer) / token", "SD of the sequence log-ratio"]
    with pytest.raises(ValueError, match=r"lacks \['loss'\]"):
        regime_table(table.drop(columns="loss"))


def test_reissue_rewrites_a_published_verdict_and_keeps_its_facts(tmp_path):
    table = _experiment(np.random.default_rng(14), {"on": 0.0, "off": -0.2}, seeds=range(3), steps=12)
    table = table[table.metric.isin(["reward_mean", "sampler_trainer_kl"])]  # two small figures: seconds
    table.to_csv(tmp_path / "metrics.csv.gz", index=False)
    write_config(OnOffConfig(arms=("on", "off"), seeds=(0, 1, 2), steps=12), tmp_path / "config.yaml")
    pd.DataFrame({"run": [f"{v}-seed{s}" for v in ("on", "off") for s in range(3)], "variant": ["on"] * 3 + ["off"] * 3,
                  "seed": [0, 1, 2] * 2, "steps_done": 12, "finished": True, "steps": 12}).to_csv(
        tmp_path / "runs.csv", index=False)
    pd.DataFrame({"wall_s": [60.0], "device": ["NVIDIA H100 80GB HBM3"], "git_sha": ["abc1234"]}).to_csv(
        tmp_path / "invocations.csv", index=False)
    facts = ["# ON/OFF experiment `custom`", "", "- date 2026-11-23; device NVIDIA H100 80GB HBM3; git abc1234", ""]
    (tmp_path / "summary.md").write_text("\n".join(facts + ["## Verdict", "", "`off`: lower than `on` (the CI "
                                                              "excludes 0).", ""]))
    for _ in range(2):  # a second re-issue gives the same file
        reissue(tmp_path, "**Statistics re-issued** (test).")
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("\n".join(facts[:3])) and text.count("**Statistics re-issued** (test).") == 1
    assert "not resolvable with 3 seeds" in text and "the CI excludes 0" not in text
    assert (tmp_path / "reward.png").exists() and "d_final_reward_p_holm" in pd.read_csv(tmp_path / "summary.csv")


def test_a_regime_report_reads_per_cell(tmp_path):
    table = _regime_experiment(15, seeds=8, effect_at_2048=0.3)
    table = table[table.metric.isin(["reward_mean", "sampler_trainer_kl", "seq_logratio_sd"])]
    table.to_csv(tmp_path / "metrics.csv.gz", index=False)
    write_config(OnOffConfig(arms=("on", "off"), seeds=tuple(range(8)), steps=20), tmp_path / "config.yaml")
    pd.DataFrame({"run": [f"{v}-seed{s}" for v in ("on", "off") for s in range(8)], "variant": ["on"] * 8 + ["off"] * 8,
                  "seed": list(range(8)) * 2, "steps_done": 20, "finished": True, "steps": 20}).to_csv(
        tmp_path / "runs.csv", index=False)
    write_report(tmp_path, window=5)
    text = (tmp_path / "summary.md").read_text()
    assert "Holm-adjusted over all 6 compared cells" in text and text.count("| 2048 | ") == 2
    assert "![regime_map](regime_map.png)" in text and (tmp_path / "regime_map.png").exists()
    assert list(pd.read_csv(tmp_path / "summary.csv").max_new_tokens) == [256, 256, 1024, 1024, 2048, 2048]


def test_published_results_are_the_newest_folder_per_preset(tmp_path):
    def folder(name, device="NVIDIA H100 80GB HBM3", figures=("reward",)):
        path = tmp_path / name
        path.mkdir()
        (path / "summary.md").write_text(f"# {name}\n\n## Verdict\n\nok\n\n## Figures\n\n![r](reward.png)\n")
        pd.DataFrame({"device": [device]}).to_csv(path / "invocations.csv", index=False)
        for fig in figures:
            (path / f"{fig}.png").write_bytes(b"png")
        return path

    folder("2026-11-23_onoff-blog-h100_1272149")
    folder("2026-11-24_onoff-blog-h100_5010901")
    folder("2026-11-24_onoff-blog-smoke-cpu_5010901", device="CPU")
    folder("2026-11-21_onoff-h100_bd5150f")  # before presets were named: not an ON/OFF report of today's form
    folder("2026-12-01_onoff-regime-h100_abcdef0", figures=("reward", "regime_map"))
    for path in tmp_path.iterdir():  # the index says which folders are ON/OFF reports, of which preset
        preset = path.name[17:].rsplit("-", 1)[0] if "-" in path.name[17:] else ""
        write_record(path, Record(path.name, "onoff" if preset else "rl", "q", {}, "x", "abc", path.name[:10], "c",
                                  "v", preset=preset.removesuffix("-smoke"), smoke=preset.endswith("-smoke")))
    write_index(tmp_path)
    found = published_results(tmp_path)
    assert [p.folder.name for p in found] == ["2026-12-01_onoff-regime-h100_abcdef0",
                                              "2026-11-24_onoff-blog-h100_5010901"]
    regime = found[0]
    assert regime.label == "published, GPU, NVIDIA H100 80GB HBM3, 2026-12-01" and regime.preset == "regime"
    assert [f.name for f in regime.figures] == ["regime_map.png", "reward.png"], "the regime map first"
    assert regime.markdown.startswith(f"**{regime.label}**") and "## Figures" not in regime.markdown
    assert published_results(tmp_path / "none") == []


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


def test_figures_read_cleanly():
    """Issue 45's findings, each as the property it broke: one title, a legend that takes no third of the figure,
    no offset label over a panel's title, whole-number ticks for counts, a legend clear of the bars."""
    rng = np.random.default_rng(12)
    table = _experiment(rng, {"on": 0.0, "off": 0.0}, seeds=(0, 1, 2), steps=30)
    table.loc[table.metric == "is_ess", "value"] = 1 - 6e-11 * rng.random((table.metric == "is_ess").sum())
    one = reward_curves(table, title="blog: reward")
    one.savefig(io.BytesIO(), format="png", dpi=40)
    assert one.get_suptitle() == "" and one.axes[0].get_title() == "blog: reward", "the title once"
    assert one.axes[0].get_legend() is not None and not one.legends, "a single panel holds its legend"
    mismatch = mismatch_panels(table, title="ON/OFF `blog`: mismatch")
    mismatch.savefig(io.BytesIO(), format="png", dpi=40)
    assert mismatch.get_suptitle() == "ON/OFF `blog`: mismatch"
    ess = next(ax for ax in mismatch.axes if ax.get_title() == "ESS fraction")
    assert ess.yaxis.get_offset_text().get_text() == "", "no '1e-5+9.9999e-1' above the panel"
    counts = next(ax for ax in mismatch.axes if ax.get_title() == "tokens differing")
    assert all(float(t).is_integer() for t in counts.get_yticks())
    hist = delta_histogram({"off (step 1)": np.where(rng.random(9) < 0.4, 0, rng.lognormal(-9, 1, 9)),
                            "on (step 1)": np.zeros(9)})
    hist.savefig(io.BytesIO(), format="png", dpi=40)
    assert all(float(t).is_integer() for t in hist.axes[0].get_yticks()), "counts have whole-number ticks"
    assert hist.axes[0].get_legend() is None and hist.legends, "the legend sits outside the axes"


def test_mismatch_panels_with_an_all_zero_arm_on_log_axes():
    table = _experiment(np.random.default_rng(8), {"on": 0.0, "off": 0.0}, seeds=(0, 1))
    table = table[table.metric.isin(["parity_tokens_differing", "parity_max_abs_diff", "sampler_trainer_kl"])]
    for data in (table, table[table.variant == "on"]):
        fig = mismatch_panels(data)
        fig.savefig(io.BytesIO(), format="png", dpi=50)  # drawing is where a zero on a log axis would fail
        kl = next(ax for ax in fig.axes if ax.get_title() == "KL(sampler || trainer)")
        notes = [t.get_text() for leg in kl.artists if isinstance(leg, Legend) for t in leg.get_texts()]
        assert "on: exactly 0 at every step" in notes, notes
        assert kl.get_yscale() == ("log" if data.variant.nunique() == 2 else "linear")


def test_reward_curves_bootstrap_every_step_at_once_for_a_full_experiment(monkeypatch):
    """What keeps a 500-step, 7-arm figure fast, counted rather than timed (a wall-clock bound is flaky on a shared
    machine): each arm's steps are resampled in one vectorised `scipy.stats.bootstrap` call, not one per step."""
    from workbench.onoff import figures

    arms = {"on": 0.0, "off": -0.1, "off-recompute": 0.0, "off-tis": 0.0, "off-mis": 0.0, "off-vllm": 0.0,
            "on-vllm": 0.0}
    s = np.arange(1, 501)
    table = pd.concat([_long(arm, seed, {"reward_mean": s / 500 + shift + 0.01 * seed}) for arm, shift in arms.items()
                       for seed in range(5)])
    calls = []
    bootstrap = figures.stats.bootstrap
    monkeypatch.setattr(figures.stats, "bootstrap", lambda *a, **k: calls.append(a[0][0].shape) or bootstrap(*a, **k))
    reward_curves(table, smooth=10)
    assert len(calls) == len(arms) and all(shape == (500, 5) for shape in calls), calls

"""The pre-registered regime map from arm records published one at a time (`onoff.regime_plan`, `regime_record`):
a planted effect in one primary cell is called and the null cells are not; the correction runs within a family and
an interim call stands; arms whose settings differ are refused; T x KL is the dose runs' mean over steps and seeds of
length x KL; an incomplete cell is reported, not tested; the figures draw; one-arm experiments publish as arm records
that the map command reads; a run cut in one hold is read from the hold that finished it."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from workbench.__main__ import main
from workbench.config import write_config
from workbench.onoff import arm_records, publish, runner
from workbench.onoff.comparison_figures import CURVES, plan_curves, plan_map, plan_mismatch
from workbench.onoff.paired import holm
from workbench.onoff.config import preset
from workbench.onoff.regime_plan import (CELLS, SEEDS, STEPS, RegimeMapConfig, assemble, detectable_effect,
                                        map_table)
from workbench.onoff.regime_record import GRID, map_message, publish_map, published_arms
from workbench.records import Record, read_record, stale, write_record

_METRICS = ("reward_mean", "response_length", "sampler_trainer_kl", "seq_logratio_sd", "token_ratio_outside_0.2",
            "seq_sum_ratio_outside_0.2", "is_ess", "parity_tokens_differing")


def _runs(arm: str, finals: dict[int, float], rng, steps: int = STEPS, noise: float = 0.0,
          kl: float = 0.0) -> pd.DataFrame:
    """Long metrics of one arm's runs: per seed a constant reward `finals[seed]` plus per-step noise, and a
    mismatch of size `kl` (0: none) with random lengths."""
    s = np.arange(1, steps + 1)
    parts = []
    for seed, final in finals.items():
        length = rng.uniform(200, 900, steps)
        k = kl * rng.uniform(0.5, 1.5, steps)
        values = {"reward_mean": final + rng.normal(0, noise, steps), "response_length": length,
                  "sampler_trainer_kl": k, "seq_logratio_sd": np.sqrt(2 * length * k),
                  "token_ratio_outside_0.2": 10 * k, "seq_sum_ratio_outside_0.2": np.minimum(1, 100 * k),
                  "is_ess": 1 - np.minimum(0.9, 10 * k), "parity_tokens_differing": (k > 0) * 5.0,
                  "entropy": 0.1 + 10 * k}
        parts += [pd.DataFrame({"step": s, "metric": m, "value": v, "variant": arm, "seed": seed})
                  for m, v in values.items()]
    return pd.concat(parts, ignore_index=True)


def _arm(root, arm, length, loss, table, finished=True, steps=STEPS, sha="abc1234", **settings):
    """An arm record as `publish` writes one (metrics.csv.gz, runs.csv, config.yaml, invocations.csv,
    result.json)."""
    folder = root / f"2026-12-03_onoff-regime-arm-{arm.replace('=', '')}-L{length}-{loss}-h200_{sha}"
    folder.mkdir(parents=True)
    table.to_csv(folder / "metrics.csv.gz", index=False)
    seeds = sorted(set(table.seed))
    pd.DataFrame({"run": [f"{arm}-seed{s}" for s in seeds], "variant": arm, "seed": seeds,
                  "steps_done": int(table.step.max()), "finished": finished, "steps": steps}).to_csv(
        folder / "runs.csv", index=False)
    settings = {"policy": f"/warm/L{length}", **settings}
    write_config(preset("regime", arms=(arm,), seeds=tuple(seeds), max_new_tokens=length, loss=loss, steps=steps,
                        **settings), folder / "config.yaml")
    pd.DataFrame({"wall_s": [60.0], "device": ["NVIDIA H200"], "git_sha": ["abc1234"]}).to_csv(
        folder / "invocations.csv", index=False)
    write_record(folder, Record(folder.name, "onoff", "one arm", {}, "NVIDIA H200", sha, "2026-12-03", "c", "v",
                                preset="regime-arm"))
    return folder


def _cell(root, rng, arm, length, loss, effects, base=None, kl=2e-3, noise=0.02, on=True, **kw):
    """The folders of a cell's `on` (unless on=False) and dose arm: per seed a shared start (the pairing) and the dose
    shifted by effects[seed]."""
    base = rng.normal(0.4, 0.1, len(SEEDS)) if base is None else base
    folders = [_arm(root, "on", length, loss, _runs("on", dict(zip(SEEDS, base)), rng, noise=noise))] if on else []
    dose = _runs(arm, {s: b + e for s, b, e in zip(SEEDS, base, effects)}, rng, noise=noise, kl=kl)
    return folders + [_arm(root, arm, length, loss, dose, **kw)]


def _row(table, name):
    return table.set_index("name").loc[name]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_planted_primary_effect_is_called_and_the_null_cells_are_not(tmp_path, seed):
    rng = np.random.default_rng(seed)
    folders = _cell(tmp_path, rng, "noise=0.6", 1024, "blog", np.full(8, -0.1), kl=0.13)   # P1: planted
    folders += _cell(tmp_path, rng, "off", 1024, "grpo", np.zeros(8))                      # P3: null
    folders += _cell(tmp_path, rng, "off", 1024, "blog", np.zeros(8), on=False)            # P2: null, P1's `on`
    table = map_table(assemble(folders))
    p1, p2, p3 = (_row(table, n) for n in ("P1", "P2", "P3"))
    assert p1.resolved and p1.hi < 0 and p1.d == pytest.approx(-0.1, abs=0.01), f"seed {seed}: {p1.verdict}"
    assert "lower than `on`" in p1.verdict and "interim (3 of the family's 6 planned cells" in p1.verdict, \
        f"seed {seed}"
    assert not p2.resolved and not p3.resolved, f"seed {seed}: {p2.verdict}; {p3.verdict}"
    assert p1.family_in == "3 of 6" and p1.interim and p1.p == pytest.approx(2 / 2 ** 8), f"seed {seed}"
    assert p1.on_entropy == pytest.approx(0.1) and p1.dose_entropy > 0.6, "the runs' last 20 steps' entropy"
    assert not table[~table.name.isin(["P1", "P2", "P3"])].tested.any(), f"seed {seed}: only complete cells"
    # Power: all 8 same-sign at 80% needs norm.ppf(0.8 ** (1/8)) = 1.92 SDs of the paired differences.
    assert p1.detectable == pytest.approx(1.919 * p1.sd, rel=1e-3), f"seed {seed}"
    assert detectable_effect(np.r_[np.ones(4), -np.ones(4)]) == pytest.approx(1.919 * np.std([1] * 4 + [-1] * 4,
                                                                                               ddof=1), rel=1e-3)


def test_the_correction_runs_within_the_family_and_an_interim_call_stands(tmp_path):
    """Until every cell of a family is tested, a cell's p is scaled by the family's planned size (Bonferroni): a
    call made then survives the plan's Holm over the whole family, whatever the other cells show; cells of another
    family change nothing; once the family is complete, Holm over its cells."""
    rng = np.random.default_rng(2)
    agree = np.full(8, 0.05)                                                 # all 8 positive: p = 2/256
    p1 = _cell(tmp_path / "a", rng, "noise=0.6", 1024, "blog", agree, noise=0.0)
    alone = _row(map_table(assemble(p1)), "P1")
    assert alone.p == pytest.approx(2 / 256) and alone.p_holm == pytest.approx(12 / 256) and alone.resolved, \
        alone.verdict
    assert "Bonferroni-adjusted 0.0469 <= 0.05" in alone.verdict and "interim (1 of the family's 6" in alone.verdict
    s1 = _cell(tmp_path / "a", rng, "noise=0.3", 256, "blog", np.zeros(8))   # another family
    p3 = _cell(tmp_path / "a", rng, "off", 1024, "grpo", np.full(8, -0.05), noise=0.0)
    table = map_table(assemble(p1 + s1 + p3))
    for name in ("P1", "P3"):
        row = _row(table, name)
        assert row.p_holm == pytest.approx(12 / 256) and row.resolved, f"{name}: {row.verdict}"
    assert _row(table, "S1").family_in == "1 of 6" and _row(table, "P1").family_in == "2 of 6"
    # 6 of 8 positive: p = 8/256 = 0.031, <= 0.05 alone but not times the 6 planned cells: no interim call.
    weaker = _cell(tmp_path / "b", rng, "noise=0.6", 1024, "blog",
                   np.array([0.05, 0.06, 0.04, 0.07, 0.05, 0.06, -0.01, -0.01]), noise=0.0)
    held = _row(map_table(assemble(weaker)), "P1")
    assert held.p == pytest.approx(8 / 256) and held.p_holm == pytest.approx(48 / 256) and not held.resolved
    assert "Bonferroni-adjusted 0.188 > 0.05" in held.verdict, held.verdict
    # The whole primary family: Holm over its six cells.
    rest = [*_cell(tmp_path / "a", rng, "off", 1024, "blog", np.zeros(8), on=False),
            *_cell(tmp_path / "a", rng, "off-fp8", 1024, "blog", np.zeros(8), on=False),
            *_cell(tmp_path / "a", rng, "off-fp8", 1024, "grpo", np.zeros(8), on=False),
            *_cell(tmp_path / "a", rng, "noise=0.6", 1024, "grpo", np.zeros(8), on=False)]
    full = map_table(assemble(p1 + p3 + rest)).set_index("name")
    primary = full.loc[["P1", "P2", "P3", "P4", "P5", "P6"]]
    assert (primary.family_in == "6 of 6").all() and not primary.interim.any()
    assert np.allclose(primary.p_holm, holm(primary.p.to_numpy(dtype=float))), primary[["p", "p_holm"]]
    assert full.loc["P1", "resolved"] and "interim" not in full.loc["P1", "verdict"], full.loc["P1", "verdict"]


def test_gspo_cells_join_the_secondary_family_where_run(tmp_path):
    rng = np.random.default_rng(8)
    table = map_table(assemble(_cell(tmp_path, rng, "off", 512, "gspo", np.zeros(8))))
    assert list(table.name[-1:]) == ["Sg1"] and len(table) == len(CELLS) + 1
    sg1 = _row(table, "Sg1")
    assert (sg1.family, sg1.loss, sg1.arm, sg1.max_new_tokens, sg1.tested) == ("secondary", "gspo", "off", 512, True)
    assert sg1.family_in == "1 of 7" and _row(table, "S1").family_in == "1 of 7"


def test_arms_whose_settings_differ_are_refused(tmp_path):
    rng = np.random.default_rng(3)
    on, dose = _cell(tmp_path, rng, "off", 1024, "blog", np.zeros(8), lr=3e-5)
    with pytest.raises(ValueError, match=r"refusing to join .*off-L1024-blog.* with .*on-L1024-blog.*: the same cell "
                                         r"\(1024 tokens, blog\) differs in lr \(3e-05 here, 1e-05 there\)"):
        assemble([on, dose])
    with pytest.raises(ValueError, match=r"the plan \(256 tokens, blog\) differs in steps \(30 here, 300 there\)"):
        assemble([on, _arm(tmp_path / "c", "on", 256, "blog", _runs("on", {0: 0.4}, rng, steps=30), steps=30)])
    joined = assemble([on, _arm(tmp_path / "d", "on", 256, "blog", _runs("on", {0: 0.4}, rng), policy="/other")])
    assert set(joined.max_new_tokens) == {256, 1024}, "cells differ in length, loss and warm start"
    with pytest.raises(ValueError, match=r"is named 2 times"):
        assemble([on, _arm(tmp_path / "e", "on", 1024, "blog", _runs("on", {3: 0.4}, rng))])
    again = _arm(tmp_path / "f", "on", 1024, "blog", _runs("on", {3: 0.4}, rng), sha="def5678")
    with pytest.raises(ValueError, match=r"the run `on` seed 3 at 1024 tokens, blog, is in two folders"):
        assemble([on, again])


def test_arms_started_from_other_weights_under_one_path_are_refused(tmp_path):
    """Each hold warm-starts its own copy of the policy at the same path: the runner's digest of the weights, not
    the path, decides whether two arms share a start."""
    from workbench.onoff.runner import POLICY_RECORD, record_policy

    rng = np.random.default_rng(4)
    on, dose = _cell(tmp_path, rng, "off", 1024, "blog", np.zeros(8))
    from safetensors.torch import save_file

    warm = tmp_path / "warm"
    warm.mkdir()
    hold1 = {"w": torch.arange(6, dtype=torch.bfloat16)}
    for folder in (on, dose):
        save_file(hold1, warm / "model.safetensors")
        record_policy(str(warm), folder)
    assert set(assemble([on, dose]).variant) == {"on", "off"}, "the same weights join"
    hold2 = {"w": hold1["w"].clone()}
    hold2["w"][5] += 1   # one value of six moved
    save_file(hold2, warm / "model.safetensors")
    record_policy(str(warm), dose)
    assert (dose / POLICY_RECORD).exists()
    with pytest.raises(ValueError, match=r"refusing to join .*off-L1024.* with .*on-L1024.*: their starting policies "
                                         r"\(.*\) are other weights"):
        assemble([on, dose])


def test_t_x_kl_is_the_dose_runs_mean_of_length_times_kl(tmp_path):
    rng = np.random.default_rng(4)
    folders = _cell(tmp_path, rng, "off", 512, "blog", np.zeros(8), kl=3e-3)
    dose = pd.read_csv(folders[1] / "metrics.csv.gz")
    wide = dose.pivot_table(index=["seed", "step"], columns="metric", values="value")
    expected = (wide.response_length * wide.sampler_trainer_kl).groupby("seed").mean().mean()
    s5 = _row(map_table(assemble(folders)), "S5")
    assert s5.t_x_kl == pytest.approx(expected, rel=1e-12) and s5.tested
    assert s5.kl_per_token == pytest.approx(wide.sampler_trainer_kl.mean(), rel=1e-12)
    assert s5.seq_clip_share == pytest.approx(wide["seq_sum_ratio_outside_0.2"].mean(), rel=1e-12)
    assert s5.on_tokens_differing == 0, "`on` is bitwise in its own runs"


def test_an_incomplete_cell_is_reported_not_tested(tmp_path):
    rng = np.random.default_rng(5)
    base = rng.normal(0.4, 0.1, 8)
    on = _arm(tmp_path, "on", 1024, "blog", _runs("on", dict(zip(SEEDS, base)), rng))
    short = _arm(tmp_path, "off", 1024, "blog", _runs("off", dict(zip(SEEDS[:6], base - 0.3)), rng, kl=2e-3))
    cut = _arm(tmp_path, "noise=0.6", 1024, "blog", _runs("noise=0.6", dict(zip(SEEDS, base - 0.3)), rng,
                                                                     steps=150, kl=0.1), finished=False)
    table = map_table(assemble([on, short, cut]))
    for name, words in (("P2", "`off`: 6 of 8 seeds complete (0-5;"),
                        ("P1", "`noise=0.6`: 0 of 8 seeds complete (none;")):
        row = _row(table, name)
        assert not row.tested and words in row.status and np.isnan(row.d) and not row.resolved, row.status
        assert row.verdict.startswith("not tested")
    assert _row(table, "P2").family_in == "0 of 6" and np.isfinite(_row(table, "P1").t_x_kl), \
        "a published dose run's mismatch is shown though its cell is not tested"
    assert _row(table, "P3").status == "`on` not published; `off` not published"
    assert "No cell of the regime map is complete yet (3 arm records" in map_message(table, 3)
    with pytest.raises(ValueError, match="No cell of the regime map is complete yet.*P2: `off`: 6 of 8 seeds"):
        publish_map([on, short, cut], RegimeMapConfig(root=str(tmp_path)))
    grid = map_table(assemble([]))[GRID]
    assert list(grid.name) == [c.name for c in CELLS] and "No arm of the regime map" in map_message(grid.assign(
        tested=False), 0)


def test_the_figures_draw(tmp_path):
    rng = np.random.default_rng(6)
    folders = _cell(tmp_path, rng, "noise=0.6", 1024, "blog", np.full(8, -0.1), kl=0.13)
    folders += _cell(tmp_path, rng, "noise=0.6", 1024, "grpo", np.zeros(8), kl=0.13)
    folders += _cell(tmp_path, rng, "off", 256, "blog", np.zeros(8), on=False, steps=STEPS, finished=False)
    table = map_table(assemble(folders))
    fig = plan_map(table)
    fig.savefig(io.BytesIO(), format="png", dpi=50)
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["loss blog", "loss grpo"]
    assert [line.get_xdata()[0] for line in axes[0].lines if line.get_linestyle() == ":"] == [3.0, 20.0]
    assert axes[0].get_xscale() == "log"
    mism = plan_mismatch(table)
    mism.savefig(io.BytesIO(), format="png", dpi=50)
    assert len(mism.axes[0].lines) == 3, "P1, P6 and S4 (published, not complete)"
    assert [line.get_markerfacecolor() == "white" for line in mism.axes[0].lines] == [False, False, True]
    with pytest.raises(ValueError, match="no tested cell"):
        plan_map(map_table(assemble([])))
    long = assemble(folders)
    curves = plan_curves(long, table)
    curves.savefig(io.BytesIO(), format="png", dpi=50)
    titled = [ax.get_title() for ax in curves.axes if ax.get_title()]
    assert titled == ["P1: blog x noise=0.6, 1024 tokens", "P6: grpo x noise=0.6, 1024 tokens"], \
        "a column per cell with runs of both arms (S4 has no `on`)"
    runs = long[long.metric == "reward_mean"].groupby(["max_new_tokens", "loss"]).apply(
        lambda g: len(g[["variant", "seed"]].drop_duplicates()))
    per_cell = [runs[1024, "blog"], runs[1024, "grpo"]]
    assert [len(ax.lines) for ax in curves.axes] == per_cell * len(CURVES), "a line per run, in every row"
    with pytest.raises(ValueError, match="no planned cell has published runs of both"):
        plan_curves(long, table[table.name == "S4"])


def test_arms_run_together_publish_as_one_record_each(tmp_path):
    """A hold that runs `on` and a dose together (parts of their seeds, one MPS daemon) publishes one arm record
    per arm, each holding only its own runs, as if that arm had run alone; the map pairs them."""
    rng = np.random.default_rng(11)
    dest, out = tmp_path / "results", tmp_path / "together"
    seeds = SEEDS[:2]
    cfg = preset("regime", arms=("on", "noise=0.6"), seeds=tuple(seeds), max_new_tokens=1024, loss="blog",
                 policy="/warm/L1024", out_dir=str(out))
    out.mkdir()
    write_config(cfg, out / "config.yaml")
    for arm, shift in (("on", 0.0), ("noise=0.6", -0.1)):
        for seed in seeds:
            run = out / f"{arm}-seed{seed}"
            run.mkdir()
            table = _runs(arm, {seed: 0.4 + shift}, rng)
            layer = table[table.metric == "reward_mean"].assign(metric="weight_delta_l2/layer_03")
            pd.concat([table, layer, layer.assign(metric="weight_delta_l2")]).to_csv(run / "metrics.csv", index=False)
            (run / runner.RECORD).write_text(json.dumps({"config": {"steps": STEPS}, "steps": STEPS}))
    pd.DataFrame({"started": ["x"], "wall_s": [60.0], "device": ["NVIDIA H200"], "git_sha": ["abc1234"]}).to_csv(
        out / "invocations.csv", index=False)
    folders = arm_records.publish_experiment(out, dest)
    assert [f.name.split("_onoff-")[1] for f in folders] == ["regime-arm-on-L1024-blog-s0-1-h200_abc1234",
                                                            "regime-arm-noise0.6-L1024-blog-s0-1-h200_abc1234"]
    for folder, arm in zip(folders, ("on", "noise=0.6")):
        runs = pd.read_csv(folder / "runs.csv")
        assert set(runs.variant) == {arm} and sorted(runs.seed) == list(seeds), f"{folder.name} holds {list(runs.run)}"
        published = set(pd.read_csv(folder / "metrics.csv.gz").metric)
        assert "weight_delta_l2" in published and not [m for m in published if "/" in m], \
            "the per-layer weight changes stay in the runs' folders, the run-level ones are published"
        assert "mean reward over each run's last 20 steps" in (folder / "summary.md").read_text(), \
            "an arm record describes the plan's endpoint (steps 281-300)"
        assert (folder / "reward.png").exists() and not list(folder.glob("*.svg")) \
            and "[SVG]" not in (folder / "summary.md").read_text(), "an arm record's figures are PNG only"
        with Image.open(folder / "reward.png") as png:
            assert round(png.info["dpi"][0]) == publish.ARM_DPI, "arm records are drawn at their own resolution"
    status = map_table(assemble(published_arms(dest))).set_index("name").loc["P1", "status"]
    for seed in seeds:
        shutil.rmtree(out / f"noise=0.6-seed{seed}")
    with pytest.raises(ValueError, match=r"holds no run of arm\(s\) noise=0.6 .* nothing was published"):
        arm_records.publish_experiment(out, tmp_path / "elsewhere")
    assert not (tmp_path / "elsewhere").exists()
    assert status.count("2 of 8 seeds complete") == 2 and "not published" not in status, status
    assert "so far (not tested) dose - `on` by seed: 0: -0.1, 1: -0.1" in status, status


@pytest.mark.slow  # 21-23 s on 2 cores
def test_one_arm_publishes_as_an_arm_record_and_the_map_command_reads_it(tmp_path, capsys):
    """`publish` of a one-arm experiment (its run folders as the runner leaves them) names the folder by arm,
    length and loss, so arms of one day do not overwrite each other, and calls nothing; `regime-map` builds the map
    record from the arm records in the index."""
    rng = np.random.default_rng(7)
    dest = tmp_path / "results"
    base = rng.normal(0.4, 0.1, 8)
    # `off` comes in two parts (seeds 0-3 and 4-7, as two GPU holds would run it): two records, one arm.
    parts = [("on", 0.0, 0.0, SEEDS), ("noise=0.6", -0.1, 0.1, SEEDS), ("off", 0.0, 2e-3, SEEDS[:4]),
             ("off", 0.0, 2e-3, SEEDS[4:])]
    for arm, shift, kl, seeds in parts:
        out = tmp_path / f"{arm}-{seeds[0]}"
        cfg = preset("regime", arms=(arm,), seeds=tuple(seeds), max_new_tokens=1024, loss="blog",
                     policy="/warm/L1024", out_dir=str(out))
        out.mkdir()
        write_config(cfg, out / "config.yaml")
        for seed in seeds:
            run = out / f"{arm}-seed{seed}"
            run.mkdir()
            _runs(arm, {seed: base[seed] + shift}, rng, kl=kl).to_csv(run / "metrics.csv", index=False)
            (run / runner.RECORD).write_text(json.dumps({"config": {"steps": STEPS}, "steps": STEPS}))
        pd.DataFrame({"started": ["x"], "wall_s": [60.0], "device": ["NVIDIA H200"], "git_sha": ["abc1234"]}).to_csv(
            out / "invocations.csv", index=False)
        folder = publish.publish(out, dest)
        assert folder.name.endswith(f"_onoff-regime-arm-{arm.replace('=', '')}-L1024-blog-s{seeds[0]}-{seeds[-1]}"
                                    "-h200_abc1234")
        record = read_record(folder)
        assert record.preset == "regime-arm" and "It calls nothing" in record.verdict and "=" not in folder.name[:10]
    assert len(published_arms(dest)) == 4 and publish.published_results(dest) == [], "an arm is no result alone"
    assert main(["regime-map", "--root", str(dest)]) == 0
    made = [p for p in dest.iterdir() if "_regime-map-" in p.name]
    assert len(made) == 1 and "P1 (`noise=0.6` x blog" in capsys.readouterr().out
    table = pd.read_csv(made[0] / "map.csv").set_index("name")
    assert table.loc["P1", "resolved"] and not table.loc["P2", "resolved"] and table.loc["P1", "family_in"] == "2 of 6"
    assert table.loc["P2", "status"] == "complete", "the two parts of `off` make one complete arm"
    assert read_record(made[0]).preset == "regime-map" and (made[0] / "plan_map.png").exists() \
        and (made[0] / "plan_curves.svg").exists()
    assert [p.folder.name for p in publish.published_results(dest)] == [made[0].name]
    assert not stale(dest), "the map command left the index current"
    elsewhere = tmp_path / "elsewhere" / "map"
    assert main(["regime-map", "--root", str(dest), "--out", str(elsewhere)]) == 0 and (elsewhere / "map.csv").exists()
    assert not (tmp_path / "elsewhere" / "index.json").exists() and not stale(dest)
    assert main(["regime-map", str(tmp_path / "nowhere")]) == 2


def test_a_cut_run_is_read_from_the_hold_that_finished_it(tmp_path):
    """The plan's parts: runs cut by one hold's time limit are rerun whole in a later hold from the same weights.
    The finished copy stands in for the cut one, the steps both ran are compared bit for bit, and two finished
    copies stay an error."""
    rng = np.random.default_rng(6)
    whole = _runs("on", dict(zip(SEEDS, rng.normal(0.4, 0.1, 8))), rng, noise=0.02)
    first = _arm(tmp_path, "on", 1024, "blog", whole[(whole.seed < 4) | (whole.step <= 220)])
    pd.DataFrame({"run": [f"on-seed{s}" for s in SEEDS], "variant": "on", "seed": SEEDS,
                  "steps_done": [STEPS if s < 4 else 220 for s in SEEDS], "finished": [s < 4 for s in SEEDS],
                  "steps": STEPS}).to_csv(first / "runs.csv", index=False)
    second = _arm(tmp_path, "on", 1024, "blog", whole[whole.seed >= 4], sha="def5678")
    dose = _arm(tmp_path, "off", 1024, "blog", _runs("off", dict(zip(SEEDS, rng.normal(0.4, 0.1, 8))), rng,
                                                     kl=2e-3))
    long = assemble([first, second, dose])
    cut = long.attrs["superseded"]
    assert sorted(cut.seed) == [4, 5, 6, 7] and (cut.steps_dropped == 220).all() and cut.rewards_agree.all(), cut
    on = long[long.variant == "on"]
    assert on.groupby("seed").source.nunique().eq(1).all() and set(on[on.seed >= 4].source) == {second.name}
    assert on.groupby("seed").step.max().eq(STEPS).all()
    row = _row(map_table(long), "P2")
    assert row.tested and row.on_seeds == "0-7", row.status

    changed = whole[whole.seed >= 4].copy()
    changed.loc[(changed.metric == "reward_mean") & (changed.step == 7) & (changed.seed == 5), "value"] += 1e-9
    other = _arm(tmp_path / "g", "on", 1024, "blog", changed, sha="0123abc")
    flags = assemble([first, other]).attrs["superseded"].set_index("seed").rewards_agree
    assert not flags[5] and flags.drop(5).all(), "one reward of a rerun differs by 1e-9: its seed is flagged"
    out = publish_map([first, other, dose], RegimeMapConfig(root=str(tmp_path), out=str(tmp_path / "maps" / "map")))
    text = (out / "README.md").read_text()
    assert "WARNING: `on` seed 5 at 1024 tokens, blog, rerun whole in" in text and "| NO |" in text
    assert "the trainer's entropy per token over the same steps, `on` 0.100, dose" in text, text
    with pytest.raises(ValueError, match=r"seed 4 at 1024 tokens, blog, is in two folders .* and 2 of them finished"):
        assemble([second, other])

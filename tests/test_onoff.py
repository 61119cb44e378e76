"""The ON/OFF experiment on CPU with the tiny self-trained policy: the arms, the presets' smoke versions, and
the runner's promises (finished runs are read back, a changed config is refused, a run cut into pieces by a
time limit ends with the same metrics as one run straight through)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import once_per_run

from workbench.onoff import publish, runner
from workbench.onoff.arms import ARMS, arm_settings, get_arm
from workbench.onoff.config import PRESETS, OnOffConfig, preset
from workbench.onoff.runner import collect, run_on_off, run_status, total_wall_s
from workbench.onoff.stats import summarize, verdict

TIMES = ("time_generate", "time_score", "time_train", "time_sync", "time_step", "tokens_per_s")


def _cfg(tmp_path, **kw):
    base = OnOffConfig(out_dir=str(tmp_path), arms=("off", "off-tis"), seeds=(0, 1), steps=2, prompts_per_step=2,
                       group_size=3, max_new_tokens=3, policy_steps=30, device="cpu", progress=False)
    return dataclasses.replace(base, **kw)


@pytest.fixture(scope="session")
def starting(tmp_path_factory) -> Path:
    """The starting policy `_cfg`'s experiments train into out_dir/policy, trained once for the whole run
    (helpers.once_per_run; a module fixture was trained again at each of xdist's switches between modules): `_ready`
    copies it into each experiment's folder, where the runner reuses it (trained with the same settings). Each
    training runs the interpreted embedding backward at every step, which the tests need not pay again."""
    return once_per_run(tmp_path_factory, "onoff_starting",
                        lambda folder: Path(runner.starting_policy(_cfg(folder))))


def _ready(folder: Path, starting: Path) -> Path:
    """`folder` with the module's starting policy in it, as a first call of the runner would leave it."""
    shutil.copytree(starting, folder / "policy")
    return folder


def _without_times(table):
    return table[~table.metric.isin(TIMES)].sort_values(["variant", "seed", "step", "metric"]).reset_index(drop=True)


def test_arms_set_only_where_the_log_probs_come_from():
    assert arm_settings("on", False)["kernel_mode"] == "invariant"
    off = arm_settings("off", False)
    assert (off["kernel_mode"], off["old_logprobs"], off["correction"]) == ("standard", "sampler", "none")
    assert arm_settings("off-tis", False)["correction"] == "tis-token"
    assert arm_settings("off-mis", True)["correction"] == "mask-sequence", "a sequence-level loss: sequence weights"
    assert arm_settings("off-vllm", False)["sync"] == "copy" and get_arm("off-vllm").vllm_model == "vllm"
    noise = arm_settings("noise=0.03", False)
    assert (noise["kernel_mode"], noise["sampler_noise"], noise["variant"]) == ("invariant", 0.03, "noise=0.03")
    for bad in ("noise=-1", "noise=abc", "noise=0", "fast"):
        with pytest.raises(ValueError, match="arm"):
            get_arm(bad)
    assert set(PRESETS["blog"]["arms"]) <= set(ARMS)


def test_runs_are_reused_only_with_the_same_settings(tmp_path, starting):
    table = run_on_off(_cfg(_ready(tmp_path, starting), keep_checkpoints=False))
    assert set(table.seed) == {0, 1} and set(table.variant) == {"off", "off-tis"} and table.step.max() == 2
    assert not (tmp_path / "off-seed0" / "checkpoints").exists(), "keep_checkpoints=False deletes them once done"
    assert json.loads((tmp_path / "off-seed0" / "run.json").read_text())["steps"] == 2
    again = run_on_off(_cfg(tmp_path, keep_checkpoints=False))
    assert again.equals(table), "a finished run is read back, not re-run"
    with pytest.raises(ValueError, match=r"other settings .*'lr'"):
        run_on_off(_cfg(tmp_path, lr=5e-3))
    with pytest.raises(ValueError, match="checkpoints were deleted"):
        run_status(_cfg(tmp_path, steps=6).run_config("off", 0, str(tmp_path / "policy")))
    with pytest.raises(ValueError, match="starting policy trained with other settings"):
        run_on_off(_cfg(tmp_path, policy_steps=31))
    runs = collect(tmp_path)
    assert len(runs) == len(table)
    assert total_wall_s(tmp_path) > 0
    summary = summarize(table, window=2)
    assert list(summary.variant) == ["off", "off-tis"] and (summary.runs == 2).all()
    assert "off-tis" in verdict(summary)


@pytest.mark.slow
def test_a_time_limit_cuts_the_experiment_into_pieces_with_the_same_result(tmp_path, starting):
    whole = run_on_off(_cfg(_ready(tmp_path / "whole", starting), seeds=(0,)))
    cfg = _cfg(_ready(tmp_path / "pieces", starting), seeds=(0,), checkpoint_every=1, time_limit_min=1e-6)
    calls, finished = 0, 0
    while finished < 2 and calls < 12:
        calls += 1
        table = run_on_off(cfg)
        finished = int(pd.read_csv(tmp_path / "pieces" / "runs.csv").finished.sum())
    assert finished == 2 and calls == 4, "each call goes one step further (the first run always makes progress)"
    assert _without_times(table).equals(_without_times(whole)), "pieces give the same metrics, bit for bit"


def test_a_cut_run_is_drawn_but_left_out_of_the_endpoints(tmp_path, monkeypatch, starting):
    cfg = _cfg(_ready(tmp_path, starting), seeds=(0,), steps=2, checkpoint_every=1, time_limit_min=1e-6)
    run_on_off(cfg)  # one step a call
    folder = publish.report(tmp_path)
    text = (folder / "summary.md").read_text()
    assert "No run finished" in text and "nothing tested" in text and "`off-seed0` at step 1 of 2" in text
    assert "| `off-seed0` | 1 | " in text, "where each run got to, described"
    assert (folder / "reward.png").exists() and not (folder / "summary.csv").exists(), "curves, no endpoints"
    for _ in range(2):  # `off` finishes, `off-tis` stops after its first step
        run_on_off(cfg)
    drawn = {}

    def recording(name):
        real = getattr(publish, name)

        def draw(table, *args, **kwargs):
            drawn[name] = set(table.variant)
            return real(table, *args, **kwargs)
        return draw

    for name in ("reward_curves", "mismatch_panels"):
        monkeypatch.setattr(publish, name, recording(name))
    folder = publish.report(tmp_path)
    assert list(pd.read_csv(folder / "summary.csv").variant) == ["off"], "endpoints from finished runs only"
    assert "off-tis-seed0 at step 1" in (folder / "summary.md").read_text()
    assert drawn == {"reward_curves": {"off", "off-tis"}, "mismatch_panels": {"off", "off-tis"}}, \
        "the curves show the cut run up to where it got"


def test_out_of_memory_with_shared_workers_says_what_to_do():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 MiB")
    advice = runner._advice([("a/off-seed1", oom), ("a/on-seed0", ValueError("bad"))], workers=11)
    assert "1 run(s) ran out of GPU memory with 11 workers" in advice and "workers=5" in advice
    assert runner._advice([("a/off-seed1", oom)], workers=1) == "", "alone on the device: nothing to share"
    assert runner._advice([("a/on-seed0", ValueError("bad"))], workers=4) == ""


def test_each_run_process_takes_its_share_of_the_host_threads(monkeypatch):
    """N run processes on one host split its cores (OMP_NUM_THREADS wins where set), as torchrun does: a process
    per run starting a thread per core oversubscribes the host that launches their kernels."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 16)
    assert [runner.worker_threads(n) for n in (1, 4, 16, 32)] == [16, 4, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runner.worker_threads(16) == 3
    seen = []
    monkeypatch.setattr(runner, "execute", lambda *a, **k: seen.append(torch.get_num_threads()) or "done")
    before = torch.get_num_threads()
    try:
        assert runner._execute_in_worker({}, 0.0, False, True, None, threads=1) == "done" and seen == [1]
    finally:
        torch.set_num_threads(before)


def test_smoke_shrinks_any_preset_to_a_cpu_check():
    """(The nightly's smoke test runs the blog, blog-dose and realistic presets' smoke versions.)"""
    for name in PRESETS:
        cfg = preset(name, smoke=True)
        assert cfg.arms == PRESETS[name].get("arms", OnOffConfig.arms)[:2] and cfg.run.steps == 2 and cfg.run.policy == ""
        assert cfg.run.device == "cpu" and cfg.run.data.task == "arithmetic"
        assert cfg.run_config(cfg.arms[0], 0).objective.loss == cfg.run.objective.loss


def test_bad_experiment_configs():
    with pytest.raises(ValueError, match="unknown arm 'fast'"):
        OnOffConfig(arms=("fast",))
    with pytest.raises(ValueError, match="must not repeat"):
        OnOffConfig(arms=("on", "on"))
    with pytest.raises(ValueError, match="seeds must name"):
        OnOffConfig(seeds=())
    with pytest.raises(ValueError, match="unknown preset"):
        OnOffConfig(preset="huge")
    with pytest.raises(ValueError, match="unknown policy size"):
        OnOffConfig(policy_size="huge")
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        OnOffConfig(group_size=1)
    assert OnOffConfig(loss="gspo", arms=("off-tis",)).run_config("off-tis", 0).objective.correction == "tis-sequence"

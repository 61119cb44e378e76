"""The ON/OFF experiment runner on CPU (standard mode, so it takes seconds): finished runs are read
back, a changed config is refused instead of silently reusing old results, and the summary."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workbench.rl.experiment import OnOffConfig, run_on_off, summarize_on_off


def _cfg(tmp_path, **kw):
    base = OnOffConfig(out_dir=str(tmp_path), modes=("standard",), seeds=(0, 1), steps=4, prompts_per_step=2,
                       group_size=3, max_new_tokens=3, policy_steps=30, device="cpu", progress=False)
    return dataclasses.replace(base, **kw)


def test_runs_are_reused_only_with_the_same_settings(tmp_path):
    table = run_on_off(_cfg(tmp_path))
    assert set(table.seed) == {0, 1} and set(table.variant) == {"standard"} and table.step.max() == 4
    saved = json.loads((tmp_path / "policy" / "policy_config.json").read_text())
    assert saved["max_steps"] == 30 and saved["size"] == "tiny"
    again = run_on_off(_cfg(tmp_path))
    assert again.equals(table), "a finished run is read back, not re-run"
    with pytest.raises(ValueError, match=r"other settings .*'lr'"):
        run_on_off(_cfg(tmp_path, lr=5e-3))
    with pytest.raises(ValueError, match="starting policy trained with other settings"):
        run_on_off(_cfg(tmp_path, policy_steps=31))
    summary = summarize_on_off(table).iloc[0]
    assert summary.runs == 2 and summary.steps == 4 and summary.steps_with_differing_tokens >= 0
    one_step = summarize_on_off(table[table.step == 1]).iloc[0]
    assert one_step.reward_gain != one_step.reward_gain, "a one-step run has no gain (NaN)"


def test_bad_experiment_configs():
    with pytest.raises(ValueError, match="modes must be"):
        OnOffConfig(modes=("fast",))
    with pytest.raises(ValueError, match="seeds must name"):
        OnOffConfig(seeds=())
    with pytest.raises(ValueError, match="unknown policy size"):
        OnOffConfig(policy_size="huge")
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        OnOffConfig(group_size=1)

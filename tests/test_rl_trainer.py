"""The GRPO trainer on CPU: parity every step in invariant mode, same seed -> same table, bitwise resume."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from workbench.__main__ import main
from workbench.rl.policy import PolicyConfig, train_policy
from workbench.rl.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    out = tmp_path_factory.mktemp("policy")
    train_policy(PolicyConfig(max_steps=30, eval_every=30, eval_problems=8, device="cpu"), out)
    return str(out)


def _cfg(policy, out, **kw):
    base = TrainConfig(policy=policy, out_dir=str(out), steps=3, prompts_per_step=3, group_size=3,
                       max_new_tokens=3, kernel_mode="standard", checkpoint_every=1, lr=3e-3)
    return dataclasses.replace(base, **kw)


def test_invariant_step_has_exact_parity(policy, tmp_path):
    table = train(_cfg(policy, tmp_path, kernel_mode="invariant", steps=1))
    value = table.set_index("metric")["value"]
    assert value["parity_tokens_differing"] == 0 and value["parity_max_abs_diff"] == 0
    assert value["ratio_mean"] == 1.0, "on-policy: the PPO ratio is exactly 1"
    assert set(table.columns) == {"step", "metric", "value", "variant", "seed"}


def test_same_seed_same_metrics_and_resume_is_bitwise(policy, tmp_path):
    full = train(_cfg(policy, tmp_path / "a"))
    again = train(_cfg(policy, tmp_path / "b"))
    timing = full.metric.str.startswith("time_") | (full.metric == "tokens_per_s")
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True), again[~timing].reset_index(drop=True))
    train(_cfg(policy, tmp_path / "c", steps=2))
    resumed = train(_cfg(policy, tmp_path / "c", steps=3, resume=True))
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True),
                                  resumed[~timing[: len(resumed)].values].reset_index(drop=True))
    a = load_file(tmp_path / "a" / "checkpoint" / "masters.safetensors")
    c = load_file(tmp_path / "c" / "checkpoint" / "masters.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a), "resumed weights differ from the uninterrupted run"


def test_sync_modes_check_the_weights(policy, tmp_path):
    for sync in ("copy", "checkpoint"):
        table = train(_cfg(policy, tmp_path / sync, steps=1, sync=sync))
        assert (table.metric == "time_sync").any()


def test_bad_training_inputs(policy, tmp_path):
    with pytest.raises(ValueError, match="unknown loss"):
        TrainConfig(loss="ppo2")
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        TrainConfig(group_size=1)
    with pytest.raises(ValueError, match="lr must be a positive number"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="unknown correction"):
        TrainConfig(correction="magic")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_cfg(policy, tmp_path / "none", resume=True))
    from workbench.models import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        train(_cfg(str(tmp_path / "missing-policy"), tmp_path / "x"))
    with pytest.raises(SystemExit):
        main(["train", "--group-size", "1"])


def test_cli_reports_a_missing_policy_without_a_traceback(tmp_path, capsys):
    assert main(["train", "--policy", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err


def test_resume_refuses_another_config(policy, tmp_path):
    train(_cfg(policy, tmp_path, steps=1))
    with pytest.raises(ValueError, match="config differs from the checkpoint's in .*lr"):
        train(_cfg(policy, tmp_path, steps=2, resume=True, lr=1e-2))


@pytest.mark.parametrize("in_reward", [False, True])
def test_kl_to_the_frozen_start_is_zero_then_grows(policy, tmp_path, in_reward):
    table = train(_cfg(policy, tmp_path, steps=4, kl_coef=0.1, kl_in_reward=in_reward))
    kl = table[table.metric == "kl"].set_index("step")["value"]
    moved = table[table.metric == "weight_delta_l2"].set_index("step")["value"].cumsum()
    assert kl[1] == 0.0, "the policy is the reference at the first step"
    later = [s for s in (2, 3, 4) if moved[s - 1] > 0]
    assert later and all(kl[s] > 0 for s in later), "once the weights moved, the KL to the start is positive"
    with pytest.raises(ValueError, match="kl_coef must be"):
        TrainConfig(kl_coef=-1.0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        TrainConfig(kl_estimator="k9")

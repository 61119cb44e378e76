"""The GRPO trainer on CPU: parity every step in invariant mode, same seed -> same table, bitwise resume."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from workbench.__main__ import main
from workbench.config import read_config_file
from workbench.rl.checkpoint import latest_checkpoint
from workbench.rl.config import TrainConfig
from workbench.rl.trainer import train


def _cfg(policy, out, **kw):
    base = TrainConfig(policy=policy, out_dir=str(out), steps=3, prompts_per_step=3, group_size=3,
                       max_new_tokens=3, kernel_mode="standard", checkpoint_every=1, lr=3e-3)
    return dataclasses.replace(base, **kw)


SMALL = dict(prompts_per_step=2, group_size=2)
"""4 sequences a step for the invariant runs: every interpreted kernel runs a program per row, and the parity and
sync checks need no more rows."""


def test_invariant_step_has_exact_parity(policy, tmp_path):
    cfg = _cfg(policy, tmp_path, kernel_mode="invariant", steps=1, **SMALL)
    table = train(cfg)
    assert TrainConfig(**read_config_file(tmp_path / "config.yaml", TrainConfig)) == cfg, "the resolved settings"
    value = table.set_index("metric")["value"]
    assert value["parity_tokens_differing"] == 0 and value["parity_max_abs_diff"] == 0
    # Not parity evidence (it holds in standard mode too): the old log-probs are recomputed on these weights.
    assert value["ratio_mean"] == 1.0, "one mini-batch on the weights that sampled: the ratio is exactly 1"
    assert set(table.columns) == {"step", "metric", "value", "variant", "seed"}
    assert value["entropy"] > 0 and value["policy_lag"] == 0 and 0 <= value["accuracy_exact"] <= 1
    # One epoch of one mini-batch on the weights that sampled: the update's forward scored the step (step.py's
    # scores_in_update), so no scoring pass of its own took time.
    assert value["time_score"] == 0 < value["time_train"], "the parity check's forward is the update's"
    assert 0 <= value["reward_positive"] <= 1 and "accuracy" not in value, "reward > 0 is named for what it is"
    layers = [m for m in value.index if m.startswith("weight_rel_change/layer_")]
    assert layers == ["weight_rel_change/layer_00", "weight_rel_change/layer_01"]
    assert all(value[m] >= 0 for m in layers) and value["weight_delta_l2/embed"] >= 0


@pytest.mark.slow
def test_one_step_lag_keeps_parity_against_the_weights_that_sampled(policy, tmp_path):
    cfg = _cfg(policy, tmp_path / "inv", kernel_mode="invariant", steps=3, policy_lag=1, sync="copy", kl_coef=0.1,
               kl_to="sampler", **SMALL)
    by = train(cfg).pivot(index="step", columns="metric", values="value")
    assert list(by["policy_lag"]) == [0, 1, 1]
    assert (by["parity_tokens_differing"] == 0).all(), "the lagged generator still matches the trainer bitwise"
    # Step s samples with version s - 2: parity must hold at a step whose sampling weights had moved (step 3's).
    assert by["weight_delta_l2"][1] > 0, "step 3 sampled with unmoved weights: the check proved nothing"
    assert by["kl"][1] == 0.0, "KL to the sampler is exactly 0 when generator = trainer"
    # Standard mode, 3 steps: step 3 samples with the weights of step 1's update, older than those it trains (step
    # 2's update moved them).
    cfg = dataclasses.replace(cfg, out_dir=str(tmp_path / "std"), kernel_mode="standard")
    by = train(cfg).pivot(index="step", columns="metric", values="value")
    assert list(by["policy_lag"]) == [0, 1, 1]
    assert by["weight_delta_l2"][2] > 0 and by["ratio_mean"][3] != 1.0 and by["kl"][3] > 0
    with pytest.raises(ValueError, match="policy_lag=1 .* use sync='copy'"):
        TrainConfig(policy_lag=1)


@pytest.mark.parametrize("lag", [1, 2])
def test_lagged_resume_is_bitwise(policy, tmp_path, lag):
    """Stopped after step 1 + lag and resumed: at lag 2 the checkpoint after step 3 keeps versions 1 and 2 (the
    trainer's own is 3), and the resumed step 5 samples with version 2, read back from generator-1.safetensors."""
    kw = dict(policy_lag=lag, sync="copy", lr=1e-2, steps=1 + 2 * lag)
    full = train(_cfg(policy, tmp_path / "a", **kw))
    by = full.pivot(index="step", columns="metric", values="value")
    assert list(by["policy_lag"]) == [min(s - 1, lag) for s in by.index]
    train(_cfg(policy, tmp_path / "b", **{**kw, "steps": 1 + lag}))
    if lag == 2:
        ck = tmp_path / "b" / "checkpoints" / "step-000003"
        assert json.loads((ck / "state.json").read_text())["generator_versions"] == [1, 2]
        assert by["weight_delta_l2"][2] > 0, "versions 1 and 2 are the same bits: the resume would prove nothing"
    resumed = train(_cfg(policy, tmp_path / "b", resume=True, **kw))
    timing = full.metric.str.startswith("time_") | (full.metric == "tokens_per_s")
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True), resumed[~timing].reset_index(drop=True))
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="policy_lag must be an integer >= 0"):
            TrainConfig(policy_lag=bad, sync="copy")


def test_tensorboard_gets_the_same_numbers(policy, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    table = train(_cfg(policy, tmp_path, steps=2, tensorboard=True))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = [e.value for e in events.Scalars("reward_mean")]
    assert logged == pytest.approx(list(table[table.metric == "reward_mean"].value))
    assert "weight_rel_change/layer_01" in events.Tags()["scalars"]


def test_a_nan_loss_stops_and_keeps_the_last_good_checkpoint(policy, tmp_path, monkeypatch):
    from workbench.rl import step

    real = step.get_loss("grpo")
    calls = []

    def nan_from_step_2(logp, *args):
        calls.append(1)
        loss, stats = real.fn(logp, *args)
        return loss * (float("nan") if len(calls) >= 2 else 1.0), stats

    def poisoned(name):
        return dataclasses.replace(real, fn=nan_from_step_2)

    monkeypatch.setattr(step, "get_loss", poisoned)
    with pytest.raises(FloatingPointError, match=r"step 2: the loss is nan; the last good checkpoint \(step 1\)"):
        train(_cfg(policy, tmp_path))
    written = pd.read_csv(tmp_path / "metrics.csv")
    assert set(written.step) == {1, 2}, "the metrics so far are written"
    assert set(written[written.step == 2].metric) == {"parity_max_abs_diff", "parity_mean_abs_diff",
                                                      "parity_tokens_differing", "parity_tokens_checked",
                                                      "sampler_trainer_kl", "is_ess",
                                                      "seq_logratio_sd", "seq_ratio_outside_1.2"}
    state = (latest_checkpoint(tmp_path) / "state.json").read_text()
    assert '"step": 1' in state


def test_gsm8k_trains_from_a_checkpoint_with_its_tokenizer(tmp_path, monkeypatch):
    gsm8k = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
    if not gsm8k.exists():
        pytest.skip("the shared GSM8K copy is not beside this checkout")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from workbench.models import ModelConfig, build, save_pretrained
    from workbench.tasks import GSM8K

    text = [p.prompt + " #### " + p.answer for p in GSM8K(gsm8k).items[:300]]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>"],
                                                      show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<unk>")
    model = build(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              max_position_embeddings=512), device="cpu", dtype=torch.bfloat16, seed=0)
    save_pretrained(model, tmp_path / "ckpt", tokenizer=tok)
    cfg = _cfg(str(tmp_path / "ckpt"), tmp_path / "run", task="gsm8k", task_source=str(gsm8k), steps=1)
    metrics = set(train(cfg).metric)
    assert {"accuracy_strict", "accuracy_lenient", "reward_mean"} <= metrics
    from workbench.tasks import default_gsm8k, make_task

    monkeypatch.setenv("WORKBENCH_GSM8K", str(gsm8k))
    assert default_gsm8k() == gsm8k and len(make_task("gsm8k").items) > 1000, "the offline copy is the default"
    TrainConfig(task="gsm8k")
    monkeypatch.setenv("WORKBENCH_GSM8K", str(tmp_path / "nowhere"))
    TrainConfig(task="gsm8k")   # building a config reads no file: the data is found when the task is built
    with pytest.raises(ValueError, match="needs a source.*WORKBENCH_GSM8K"):
        train(_cfg(str(tmp_path / "ckpt"), tmp_path / "no-data", task="gsm8k"))
    assert not (tmp_path / "no-data").exists(), "a run refused at its setup leaves no folder"
    with pytest.raises(ValueError, match="needs a starting checkpoint"):
        train(_cfg("", tmp_path / "none", task="gsm8k", task_source=str(gsm8k)))


def test_same_seed_same_metrics_and_resume_is_bitwise(policy, tmp_path):
    full = train(_cfg(policy, tmp_path / "a"))
    again = train(_cfg(policy, tmp_path / "b"))
    timing = full.metric.str.startswith("time_") | (full.metric == "tokens_per_s")
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True), again[~timing].reset_index(drop=True))
    train(_cfg(policy, tmp_path / "c", steps=2))
    resumed = train(_cfg(policy, tmp_path / "c", steps=3, resume=True))
    pd.testing.assert_frame_equal(full[~timing].reset_index(drop=True),
                                  resumed[~timing[: len(resumed)].values].reset_index(drop=True))
    a = load_file(latest_checkpoint(tmp_path / "a") / "masters.safetensors")
    c = load_file(latest_checkpoint(tmp_path / "c") / "masters.safetensors")
    assert all(torch.equal(a[k], c[k]) for k in a), "resumed weights differ from the uninterrupted run"


@pytest.mark.slow
def test_sync_modes_deliver_the_weights_and_check_them(policy, tmp_path, monkeypatch):
    # The generator holds its own copy: had a sync not delivered an update, the next step's rollouts would come
    # from the old weights and the parity check (against the trainer's) would fail.
    by = train(_cfg(policy, tmp_path / "copy", sync="copy", kernel_mode="invariant", steps=2, **SMALL)).pivot(
        index="step", columns="metric", values="value")
    assert by["weight_delta_l2"][1] > 0 and (by["parity_tokens_differing"] == 0).all(), "step 2 checks the update"
    # Through disk: the starting weights' round trip (save_pretrained, load_pretrained) is checked by checksum.
    by = train(_cfg(policy, tmp_path / "checkpoint", sync="checkpoint", kernel_mode="invariant", steps=1, **SMALL))
    assert (by[by.metric == "parity_tokens_differing"].value == 0).all()
    from workbench.rl import sync as sync_module

    monkeypatch.setattr(sync_module, "copy_weights", lambda src, model: None)  # a sync that delivers nothing
    with pytest.raises(RuntimeError, match="sync path is broken"):
        train(_cfg(policy, tmp_path / "broken", sync="copy", steps=2, lr=1e-2))


def test_bad_training_inputs(policy, tmp_path):
    with pytest.raises(ValueError, match="unknown loss"):
        TrainConfig(loss="ppo2")
    with pytest.raises(ValueError, match="group_size must be at least 2"):
        TrainConfig(group_size=1)
    with pytest.raises(ValueError, match="lr must be a finite number >= 0"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="correction must be 'none', 'tis-token'"):
        TrainConfig(correction="magic")
    for correction in ("tis-token", "mask-token"):
        with pytest.raises(ValueError, match="use tis-sequence or mask-sequence"):
            TrainConfig(loss="gspo", correction=correction)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(_cfg(policy, tmp_path / "none", resume=True))
    from workbench.models import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        train(_cfg(str(tmp_path / "missing-policy"), tmp_path / "x"))
    with pytest.raises(SystemExit):
        main(["train", "--group-size", "1"])


def test_vllm_generator_settings_and_a_missing_vllm_are_named(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="generator must be"):
        TrainConfig(generator="sglang")
    with pytest.raises(ValueError, match="use sync='copy'"):
        TrainConfig(generator="vllm")
    with pytest.raises(ValueError, match="vllm_memory"):
        TrainConfig(generator="vllm", sync="copy", vllm_memory=1.5)
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed
    assert main(["train", "--generator", "vllm", "--sync", "copy", "--out-dir", str(tmp_path / "v")]) == 2
    assert "the vllm backend needs vLLM" in capsys.readouterr().err
    assert not (tmp_path / "v" / "policy").exists(), "refused before the starting policy is trained"


def test_cli_reports_a_missing_policy_without_a_traceback(tmp_path, capsys):
    assert main(["train", "--policy", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path / "o")]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err


def test_resume_refuses_another_config_and_a_rerun_never_overwrites(policy, tmp_path):
    train(_cfg(policy, tmp_path, steps=1))
    with pytest.raises(ValueError, match="already holds a run .*resume=True"):
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


def test_a_checkpoint_from_before_a_field_existed_still_resumes():
    from dataclasses import asdict

    from workbench.rl.checkpoint import config_changes

    cfg = TrainConfig(steps=7)
    older = {k: v for k, v in asdict(cfg).items() if k not in ("policy_lag", "kl_to", "task")}
    assert config_changes(older, cfg) == {}
    assert set(config_changes(older, dataclasses.replace(cfg, policy_lag=1, sync="copy"))) == {"policy_lag", "sync"}


def test_a_reward_that_raises_for_one_completion_counts_zero_and_the_run_goes_on(policy, tmp_path, monkeypatch,
                                                                                 capsys):
    from workbench.tasks import Arithmetic

    calls, reward = [], Arithmetic.reward

    def flaky(self, completion, problem):   # the 2nd and 6th rewards raise (steps 1 and 2: 4 a step)
        calls.append(completion)
        if len(calls) in (2, 6):
            raise OSError("sandbox lost\nsecond line of its traceback")
        return reward(self, completion, problem)

    monkeypatch.setattr(Arithmetic, "reward", flaky)
    monkeypatch.setattr(Arithmetic, "scores", lambda self, completion, problem: {"exact": reward(self, completion,
                                                                                                 problem)})
    by = train(_cfg(policy, tmp_path, steps=2, progress=False, **SMALL)).pivot(index="step", columns="metric",
                                                                               values="value")
    assert list(by.index) == [1, 2] and list(by["reward_failures"]) == [1, 1]
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: step 1: the reward of completion 1 raised OSError: sandbox lost; it counts 0 and "
                        "the run goes on (metric reward_failures counts them; warned once)"]


def test_the_reward_stage_finds_the_failing_completion_of_a_batch_reward():
    from types import SimpleNamespace

    from workbench.rl.rewards import RewardStage

    class Task:   # a batch reward (the code task's), and each completion's; "bad" raises in both
        def rewards(self, texts, problems):
            return [self.reward(t, p) for t, p in zip(texts, problems)]

        def reward(self, text, problem):
            if text == "bad":
                raise RuntimeError("judge crashed")
            return float(text == problem)

        def scores(self, text, problem):
            return {"exact": self.reward(text, problem)}

    texts = ["7", "bad", "3", "7"]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: texts[ids[0]])
    rollout = SimpleNamespace(problems=["7", "3"], completions=[SimpleNamespace(finish_reason="stop")] * 4)
    batch = SimpleNamespace(completions=[[i] for i in range(4)], device="cpu")
    rewards, per_sequence = RewardStage(Task(), tok, group_size=2)(1, rollout, batch)
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [(s, failed) for s, _, _, failed in per_sequence] == [({"exact": 1.0}, False), ({}, True),
                                                                ({"exact": 1.0}, False), ({"exact": 0.0}, False)]

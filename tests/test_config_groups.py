"""TrainConfig's settings in groups (rollout, objective, optim, ...): every name a setting had still reaches it (the
bare name, the dotted path one or two groups deep, a nested file table, a command-line flag), a misspelt one is a
one-line error naming the close match, and the checkpoints and run records written flat before the groups still
compare equal."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workbench.__main__ import COMMANDS, main
from workbench.config import flat_dict, get_setting, parse_overrides, read_config_file, write_config
from workbench.onoff.config import OnOffConfig
from workbench.onoff.runner import run_status
from workbench.rl.checkpoint import config_changes
from workbench.rl.config import TrainConfig

# TrainConfig's fields before the groups (the flat layout of state.json and run.json), in that order.
OLD_FIELDS = """policy chat_template out_dir kernel_mode sampler_kernels sampler_precision task task_source
question_field answer_field difficulty loss clip_low clip_high aggregation steps prompts_per_step group_size
max_new_tokens temperature sampler_noise lr weight_decay max_grad_norm master_dtype adapter lora_rank lora_alpha
lora_targets mini_batches epochs old_logprobs max_tokens_per_microbatch activation_checkpointing seed variant
time_limit_s parity parity_sample correction correction_cap kl_coef kl_to kl_estimator kl_in_reward generator
vllm_model vllm_memory keep_graphs sync policy_lag rollout_ranks parallel trainer_backend tensor_parallel
checkpoint_every resume tensorboard device progress""".split()


def _parsed(monkeypatch, argv):
    got = {}
    help_, cls, _ = COMMANDS[argv[0]]
    monkeypatch.setitem(COMMANDS, argv[0], (help_, cls, lambda cfg, args: got.setdefault("cfg", cfg) and 0))
    assert main(argv) == 0
    return got["cfg"]


def test_every_name_of_a_grouped_setting_gives_the_same_train_config(tmp_path, monkeypatch):
    want = TrainConfig(lr=1e-4, max_new_tokens=7, kl_coef=0.1)
    assert (want.optim.lr, want.rollout.max_new_tokens, want.objective.kl_coef) == (1e-4, 7, 0.1)
    assert TrainConfig(**{"optim.lr": 1e-4, "rollout.max_new_tokens": 7, "objective.kl_coef": 0.1}) == want
    assert TrainConfig(optim={"lr": 1e-4}, rollout={"max_new_tokens": 7}, kl_coef=0.1) == want
    assert dataclasses.replace(TrainConfig(), lr=1e-4, max_new_tokens=7, kl_coef=0.1) == want
    assert dataclasses.replace(want, lr=5e-4).optim == dataclasses.replace(want.optim, lr=5e-4), "the rest kept"
    f = tmp_path / "nested.toml"
    f.write_text("[optim]\nlr = 1e-4\n[rollout]\nmax_new_tokens = 7\n[objective]\nkl_coef = 0.1\n")
    assert TrainConfig(**read_config_file(f, TrainConfig)) == want
    f = tmp_path / "flat.yaml"
    f.write_text("lr: 1.0e-4\nrollout.max_new_tokens: 7\nkl_coef: 0.1\n")
    assert TrainConfig(**read_config_file(f, TrainConfig)) == want
    assert TrainConfig(**parse_overrides(["optim.lr=1e-4", "max_new_tokens=7", "objective.kl_coef=0.1"],
                                         TrainConfig)) == want
    flags = _parsed(monkeypatch, ["train", "--lr", "1e-4", "--max-new-tokens", "7", "--kl-coef", "0.1"])
    assert flags == want
    assert _parsed(monkeypatch, ["train", "optim.lr=1e-4", "max_new_tokens=7", "kl_coef=0.1"]) == want


def test_every_name_of_a_run_setting_gives_the_same_on_off_config(tmp_path, monkeypatch):
    """Two levels: OnOffConfig -> run (a TrainConfig) -> optim; `run.lr` (what existing files say) still works."""
    want = OnOffConfig(lr=1e-5, group_size=3)
    assert (want.run.optim.lr, want.run.rollout.group_size) == (1e-5, 3)
    for names in ({"run.lr": 1e-5, "run.group_size": 3}, {"run.optim.lr": 1e-5, "run.rollout.group_size": 3},
                  {"run": {"optim": {"lr": 1e-5}, "group_size": 3}}):
        assert OnOffConfig(**names) == want, names
    for text in ("run:\n  optim:\n    lr: 1.0e-5\n  rollout:\n    group_size: 3\n",
                 "run:\n  lr: 1.0e-5\n  group_size: 3\n", "run.optim.lr: 1.0e-5\nrun.group_size: 3\n",
                 "lr: 1.0e-5\ngroup_size: 3\n"):
        (tmp_path / "c.yaml").write_text(text)
        assert OnOffConfig(**read_config_file(tmp_path / "c.yaml", OnOffConfig)) == want, text
    assert _parsed(monkeypatch, ["on-off", "--lr", "1e-5", "--group-size", "3"]) == want
    assert _parsed(monkeypatch, ["on-off", "run.optim.lr=1e-5", "run.group_size=3"]) == want
    regime = _parsed(monkeypatch, ["on-off", "--preset", "regime", "lr=1e-6"])
    assert (regime.run.optim.lr, regime.run.data.task, regime.run.rollout.max_new_tokens) == (1e-6, "counting", 2048)
    assert get_setting(want, "run.lr") == get_setting(want, "lr") == 1e-5


@pytest.mark.parametrize("cfg", [TrainConfig(lr=2e-6, adapter="lora", lora_rank=4),
                                 OnOffConfig(lr=3e-6, kl_coef=0.01, seeds=(0, 1))])
def test_the_written_settings_are_grouped_and_read_back(tmp_path, cfg):
    write_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "\noptim:\n" in text or "\n  optim:\n" in text, "the groups as nested tables"
    assert type(cfg)(**read_config_file(tmp_path / "config.yaml", type(cfg))) == cfg


def test_an_unknown_grouped_setting_names_the_close_one():
    cases = [(TrainConfig, "optim.lrr=1", "optim.lr"), (TrainConfig, "rollout.group_sise=3", "rollout.group_size"),
             (TrainConfig, "lora_rnak=3", "lora_rank"), (OnOffConfig, "run.optim.lrr=1", "run.optim.lr"),
             (OnOffConfig, "run.lrr=1", "run.lr"), (OnOffConfig, "lrr=1", "lr")]
    for cls, item, near in cases:
        with pytest.raises(ValueError) as e:
            parse_overrides([item], cls)
        message = str(e.value)
        assert "\n" not in message and f"did you mean {near!r}?" in message, (item, message)
    with pytest.raises(TypeError, match=r"unknown setting 'lrr' for TrainConfig; did you mean 'lr'\?"):
        TrainConfig(lrr=1e-3)
    with pytest.raises(ValueError, match="optim.lr must be float, got 'fast'"):
        parse_overrides(["optim.lr=fast"], TrainConfig)
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0, got -1"):
        TrainConfig(lr=-1)   # a group's own check names the setting as before
    with pytest.raises(ValueError, match="sampler_kernels='engine' .* needs kernel_mode='standard'"):
        TrainConfig(sampler_kernels="engine")   # a check across groups: TrainConfig's


def _old_layout(cfg: TrainConfig) -> dict:
    """The config as a state.json or run.json written before the groups held it (flat, JSON's lists)."""
    return json.loads(json.dumps({name: get_setting(cfg, name) for name in OLD_FIELDS}))


def test_a_flat_state_written_before_the_groups_compares_equal():
    cfg = TrainConfig(steps=4, lr=3e-3, policy_lag=1, sync="copy", adapter="lora", lora_targets=("q_proj",))
    old = _old_layout(cfg)
    added = {"packed_sequences"}   # settings added since the groups: a saved config without them reads the default
    assert list(flat_dict(cfg)) != OLD_FIELDS and set(flat_dict(cfg)) - added == set(OLD_FIELDS), "the same names"
    assert config_changes(old, cfg) == {}
    assert config_changes(old, dataclasses.replace(cfg, lr=1e-3, steps=9)) == {"lr": (3e-3, 1e-3)}, \
        "a changed setting by its bare name; steps may change on resume"
    assert config_changes(json.loads(json.dumps({"config": flat_dict(cfg)}))["config"], cfg) == {}, "and new ones"


def test_an_on_off_run_recorded_before_the_groups_is_still_done_or_resumed(tmp_path):
    run = OnOffConfig(out_dir=str(tmp_path), steps=2, arms=("on",)).run_config("on", 0, "policy")
    (tmp_path / "on-seed0").mkdir()
    (tmp_path / "on-seed0" / "run.json").write_text(json.dumps({"config": _old_layout(run), "steps": 2}))
    assert run_status(run) == "done"
    with pytest.raises(ValueError, match=r"other settings \{'lr': \(0.001, 0.002\)\}"):
        run_status(dataclasses.replace(run, lr=2e-3))
    (tmp_path / "on-seed0" / "run.json").unlink()
    step = tmp_path / "on-seed0" / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 1, "config": _old_layout(run)}))
    assert run_status(run) == "partial"

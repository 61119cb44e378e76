"""Run settings from YAML/TOML files and key=value overrides, checked by the experiments' own dataclasses, and the
resolved settings every run writes next to its metrics."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from workbench.__main__ import COMMANDS, main
from workbench.config import parse_overrides, read_config_file, write_config
from workbench.nightly import NightlyConfig
from workbench.rl.config import TrainConfig
from workbench.onoff.config import OnOffConfig


def _capture(monkeypatch, command):
    got = {}
    help_, cls, _ = COMMANDS[command]
    monkeypatch.setitem(COMMANDS, command, (help_, cls, lambda cfg, args: got.setdefault("cfg", cfg) and 0))
    return got


def test_file_then_command_line_then_overrides(tmp_path, monkeypatch):
    f = tmp_path / "run.yaml"
    f.write_text("lr: 3e-3\nsteps: 7\nloss: dapo\nseed: 4\n")
    got = _capture(monkeypatch, "train")
    assert main(["train", "--config", str(f), "--steps", "9", "seed=5", "policy=0123"]) == 0
    cfg = got["cfg"]
    assert (cfg.optim.lr, cfg.objective.loss) == (3e-3, "dapo"), "the file's settings"
    assert cfg.steps == 9, "an option given on the command line wins over the file"
    assert cfg.seed == 5 and cfg.policy == "0123", "key=value overrides come last; a str field keeps its text"
    assert cfg.rollout.max_new_tokens == TrainConfig().rollout.max_new_tokens, "the rest are the defaults"


def test_toml_and_tuples_for_the_experiment(tmp_path, monkeypatch):
    f = tmp_path / "on_off.toml"
    f.write_text('seeds = [0, 1, 2]\narms = ["on", "off-tis"]\nsteps = 5\n')
    got = _capture(monkeypatch, "on-off")
    assert main(["on-off", "--config", str(f), "mini_batches=2"]) == 0
    assert got["cfg"].seeds == (0, 1, 2) and got["cfg"].run.steps == 5 and got["cfg"].run.optim.mini_batches == 2
    assert got["cfg"].arms == ("on", "off-tis")


def test_a_preset_is_the_base_that_files_options_and_overrides_change(tmp_path, monkeypatch):
    from workbench.onoff.config import PRESETS

    got = _capture(monkeypatch, "on-off")
    assert main(["on-off", "--preset", "blog", "--steps", "7", "seeds=[1]"]) == 0
    cfg = got["cfg"]
    run = cfg.run
    assert (run.objective.loss, run.data.task, run.optim.lr, run.optim.master_dtype, run.optim.max_grad_norm) == (
        "blog", "facts", 1e-5, "bfloat16", 1.0)
    assert cfg.arms == PRESETS["blog"]["arms"] and (run.steps, cfg.seeds) == (7, (1,))
    f = tmp_path / "dose.yaml"
    f.write_text("preset: blog-dose\nsmoke: true\n")
    got.clear()
    assert main(["on-off", "--config", str(f)]) == 0
    cfg = got["cfg"]
    assert cfg.arms == ("on", "noise=0.01") and cfg.run.policy == "" and cfg.run.steps == 2, "smoke shrinks it"
    with pytest.raises(SystemExit):
        main(["on-off", "--preset", "huge"])


@pytest.mark.parametrize("text, name, match", [
    ("lrr: 0.1\n", "a.yaml", r"unknown setting 'lrr' for TrainConfig; did you mean 'lr'\?"),
    ("steps: 1.5\n", "a.yaml", "steps must be int, got 1.5"),
    ("steps: [1\n", "a.yaml", "does not parse"),
    ("- 1\n- 2\n", "a.yaml", "must hold a table of settings"),
    ("steps = \n", "a.toml", "does not parse"),
    ("steps: 1\n", "a.json", "unknown format '.json'"),
    ("kernel_mode: fast\n", "a.yaml", "kernel_mode must be 'invariant' or 'standard'"),
])
def test_bad_config_files_are_named(tmp_path, capsys, text, name, match):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(SystemExit):
        main(["train", "--config", str(f)])
    assert re.search(match, capsys.readouterr().err)


def test_bad_overrides_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="must be key=value"):
        parse_overrides(["steps"], TrainConfig)
    with pytest.raises(ValueError, match="resume must be bool"):
        parse_overrides(["resume=maybe"], TrainConfig)
    with pytest.raises(ValueError, match="did you mean 'max_new_tokens'"):
        parse_overrides(["max_new_token=3"], TrainConfig)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_config_file(tmp_path / "nowhere.yaml", TrainConfig)


@pytest.mark.parametrize("cfg", [TrainConfig(lr=2e-6, steps=3, policy="smollm2-135m-instruct"),
                                 OnOffConfig(seeds=(0, 1, 2)), NightlyConfig()])
def test_a_written_config_reads_back_as_the_same_run(tmp_path, cfg):
    write_config(cfg, tmp_path / "config.yaml")
    again = type(cfg)(**read_config_file(tmp_path / "config.yaml", type(cfg)))
    assert again == cfg
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


def _setting_names(cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    return [name for f in dataclasses.fields(cls)
            for name in (_setting_names(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else [f.name])]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    """`python -m workbench <command> --help` lists every option (a % in a field's docstring once broke `train`'s)."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m workbench {command}")
    _, cls, _ = COMMANDS[command]
    missing = [n for n in _setting_names(cls) if "--" + n.replace("_", "-") not in out]  # groups' too (run, optim)
    assert not missing



def test_every_train_setting_reaches_an_on_off_run(tmp_path, monkeypatch):
    """`OnOffConfig.run` is a TrainConfig: a setting the arms leave alone (clip_low, kl_coef, parity_sample) is set
    for every run, by its bare name or its dotted path, on the command line or in a nested file table."""
    f = tmp_path / "on_off.yaml"
    f.write_text("arms: [on, off-tis]\nrun:\n  kl_coef: 0.05\n  lr: 2.0e-4\n")
    got = _capture(monkeypatch, "on-off")
    assert main(["on-off", "--config", str(f), "--clip-low", "0.1", "run.max_grad_norm=2", "lr=3e-4"]) == 0
    run = got["cfg"].run_config("on", 3)
    assert (run.objective.kl_coef, run.objective.clip_low, run.optim.max_grad_norm, run.optim.lr) == (
        0.05, 0.1, 2, 3e-4), "the later name wins"
    tis = got["cfg"].run_config("off-tis", 0)
    assert (run.seed, run.kernel_mode, tis.objective.correction) == (3, "invariant", "tis-token")
    assert OnOffConfig(arms=("on",), parity_sample=2).run_config("on", 0).parity_sample == 2
    with pytest.raises(ValueError, match="parity_sample=2 takes the generator's log-probs"):
        OnOffConfig(arms=("on", "off"), parity_sample=2)  # the off arm's standard kernels: checked per arm
    with pytest.raises(ValueError, match="kernel_mode is set per run by its arm"):
        OnOffConfig(kernel_mode="standard")
    with pytest.raises(ValueError, match="seed is set per run by its seed"):
        OnOffConfig(seed=1)
    with pytest.raises(ValueError, match=r"unknown setting 'run.lrr' for OnOffConfig; did you mean 'run.lr'\?"):
        parse_overrides(["run.lrr=1"], OnOffConfig)


def test_an_on_off_config_written_before_the_nesting_still_reads(tmp_path):
    """Runs folders of earlier versions hold a flat config.yaml (the run settings beside the experiment's); resume
    and the report read it."""
    f = tmp_path / "config.yaml"
    f.write_text("# OnOffConfig: the resolved settings of this run\npreset: blog\nsmoke: false\npolicy: ''\n"
                 "policy_size: tiny\nout_dir: runs/x\narms:\n- 'on'\n- 'off'\nseeds:\n- 0\nsteps: 7\ntask: facts\n"
                 "chat_template: false\nloss: blog\nlr: 1.0e-05\nmaster_dtype: bfloat16\ncheckpoint_every: 0\n"
                 "device: cpu\ntrainer_backend: workbench\ntensorboard: false\nprogress: true\n")
    cfg = OnOffConfig(**read_config_file(f, OnOffConfig))
    assert (cfg.run.steps, cfg.run.data.task, cfg.run.optim.lr, cfg.run.optim.master_dtype, cfg.arms) == (
        7, "facts", 1e-5, "bfloat16", ("on", "off"))
    write_config(cfg, f)
    assert "\nrun:\n  policy: ''\n" in f.read_text()
    assert OnOffConfig(**read_config_file(f, OnOffConfig)) == cfg

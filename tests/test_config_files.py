"""Run settings from YAML/TOML files and key=value overrides, checked by the experiments' own dataclasses, and the
resolved settings every run writes next to its metrics."""

from __future__ import annotations

import dataclasses
import re

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
    assert (cfg.lr, cfg.loss) == (3e-3, "dapo"), "the file's settings"
    assert cfg.steps == 9, "an option given on the command line wins over the file"
    assert cfg.seed == 5 and cfg.policy == "0123", "key=value overrides come last; a str field keeps its text"
    assert cfg.max_new_tokens == TrainConfig().max_new_tokens, "the rest are the defaults"


def test_toml_and_tuples_for_the_experiment(tmp_path, monkeypatch):
    f = tmp_path / "on_off.toml"
    f.write_text('seeds = [0, 1, 2]\narms = ["on", "off-tis"]\nsteps = 5\n')
    got = _capture(monkeypatch, "on-off")
    assert main(["on-off", "--config", str(f), "mini_batches=2"]) == 0
    assert got["cfg"].seeds == (0, 1, 2) and got["cfg"].steps == 5 and got["cfg"].mini_batches == 2
    assert got["cfg"].arms == ("on", "off-tis")


def test_a_preset_is_the_base_that_files_options_and_overrides_change(tmp_path, monkeypatch):
    from workbench.onoff.config import PRESETS

    got = _capture(monkeypatch, "on-off")
    assert main(["on-off", "--preset", "blog", "--steps", "7", "seeds=[1]"]) == 0
    cfg = got["cfg"]
    assert (cfg.loss, cfg.task, cfg.lr, cfg.master_dtype, cfg.max_grad_norm) == ("blog", "facts", 1e-5, "bfloat16", 1.0)
    assert cfg.arms == PRESETS["blog"]["arms"] and (cfg.steps, cfg.seeds) == (7, (1,))
    f = tmp_path / "dose.yaml"
    f.write_text("preset: blog-dose\nsmoke: true\n")
    got.clear()
    assert main(["on-off", "--config", str(f)]) == 0
    cfg = got["cfg"]
    assert cfg.arms == ("on", "noise=0.01") and cfg.policy == "" and cfg.steps == 2, "smoke shrinks it"
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


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_prints_its_help(command, capsys):
    """`python -m workbench <command> --help` lists every option (a % in a field's docstring once broke `train`'s)."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m workbench {command}")
    _, cls, _ = COMMANDS[command]
    assert all("--" + f.name.replace("_", "-") in out for f in dataclasses.fields(cls))


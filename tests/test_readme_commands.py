"""Every `python -m workbench ...` command that README.md and docs/reference.md show parses as written: its options
exist, its settings are valid for the command's config, and the cheap one runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from workbench.__main__ import main, parse
from workbench.config import write_config
from workbench.rl.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/reference.md")


def shown_commands(text: str) -> list[str]:
    """The `python -m workbench` command lines of a Markdown text's bash blocks, continuation lines joined and
    comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:3] == ["python", "-m", "workbench"]:
                commands.append(words[3:])
    return commands


COMMANDS = [(doc, argv) for doc in DOCS for argv in shown_commands((ROOT / doc).read_text())]


def test_the_docs_show_commands():
    readme = [argv[0] for doc, argv in COMMANDS if doc == "README.md"]
    assert {"demo", "nightly", "train", "on-off", "compare", "fetch-model"} <= set(readme), readme


@pytest.mark.parametrize("doc, argv", COMMANDS, ids=[f"{d}:{' '.join(a)}"[:90] for d, a in COMMANDS])
def test_each_shown_command_parses(doc, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The run the docs' `--config runs/train/config.yaml` example starts from: a default `train` run's settings.
    (tmp_path / "runs" / "train").mkdir(parents=True)
    write_config(TrainConfig(), tmp_path / "runs" / "train" / "config.yaml")
    if "cuda" in argv:   # the GPU commands: parsed as on a GPU host
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg, args = parse(argv)
    assert args.command == argv[0]
    if "--config" in argv:   # a new run, not a rerun into the folder that holds the first
        assert cfg.out_dir != "runs/train" and cfg.checkpoint.resume is False


def test_the_readme_demo_runs_as_written(capsys):
    assert ["demo"] in [argv for doc, argv in COMMANDS if doc == "README.md"]
    assert main(["demo"]) == 0
    assert "invariant  float32: row 0 identical at every M" in capsys.readouterr().out

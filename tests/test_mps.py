"""The runner's MPS daemon (onoff/mps.py), with a fake `nvidia-cuda-mps-control` on PATH that records how it was
called: started with a private pipe and log directory, seen by the workers' environment, quit in a finally, and
the fallbacks where the binary is missing or fails."""

from __future__ import annotations

import json
import os
import stat

import pytest

from workbench.onoff.config import OnOffConfig
from workbench.onoff.mps import CONTROL, MpsUnavailable, mps_daemon, wanted

_FAKE = """#!/bin/sh
printf '{"args": "%s", "pipe": "%s", "log": "%s", "stdin": "%s"}\\n' "$*" "$CUDA_MPS_PIPE_DIRECTORY" \\
  "$CUDA_MPS_LOG_DIRECTORY" "$( [ "$1" = "-d" ] || cat )" >> "$FAKE_MPS_RECORD"
exit ${FAKE_MPS_RC:-0}
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / CONTROL
    control.write_text(_FAKE)
    control.chmod(control.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return lambda: [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_daemon_starts_with_private_dirs_and_quits_even_on_error(fake, tmp_path):
    with pytest.raises(RuntimeError, match="a run failed"):
        with mps_daemon("auto", tmp_path / "out", "cuda", 2) as on:
            assert on
            pipe, log = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
            assert os.path.isdir(pipe) and pipe.startswith("/tmp/") and len(pipe) < 40
            assert log == str(tmp_path / "out" / "mps-log") and os.path.isdir(log)
            raise RuntimeError("a run failed")
    start, quit_ = fake()
    assert start == {"args": "-d", "pipe": pipe, "log": log, "stdin": ""}
    assert quit_ == {"args": "", "pipe": pipe, "log": log, "stdin": "quit"}
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and "CUDA_MPS_LOG_DIRECTORY" not in os.environ
    assert not os.path.exists(pipe)


def test_no_daemon_for_one_worker_the_cpu_or_off(fake, tmp_path):
    for setting, device, workers in (("auto", "cuda", 1), ("on", "cpu", 4), ("off", "cuda", 4)):
        with mps_daemon(setting, tmp_path, device, workers) as on:
            assert not on and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert fake() == []


def test_a_running_daemon_named_by_the_environment_is_joined_not_started(fake, tmp_path, monkeypatch, capsys):
    """Several runner calls of one GPU hold share the caller's daemon: none of them starts or quits one (a call that
    quit it would cut the others' clients off). The control: a pipe directory without a control socket is no
    daemon, and the call starts (and quits) its own, as before."""
    pipe = tmp_path / "outer"
    pipe.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    (pipe / "control").touch()
    with mps_daemon("on", tmp_path / "out", "cuda", 4) as on:
        assert on, "its workers are the daemon's clients"
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe), "the workers connect to the caller's daemon"
    assert fake() == [], "nothing started or quit"
    assert "join the running daemon of " + str(pipe) in capsys.readouterr().out
    (pipe / "control").unlink()
    with mps_daemon("on", tmp_path / "out", "cuda", 4) as on:
        assert on and os.environ["CUDA_MPS_PIPE_DIRECTORY"] != str(pipe)
    assert [c["args"] for c in fake()] == ["-d", ""]
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe), "the caller's setting is restored"


def test_missing_binary_warns_for_auto_and_refuses_for_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))   # no control binary anywhere
    with mps_daemon("auto", tmp_path, "cuda", 3) as on:
        assert not on
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning:") and CONTROL in lines[0], lines
    with pytest.raises(MpsUnavailable, match="mps='on'"):
        with mps_daemon("on", tmp_path, "cuda", 3):
            pass


def test_failing_start_falls_back_for_auto(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_MPS_RC", "3")
    with mps_daemon("auto", tmp_path, "cuda", 2) as on:
        assert not on and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert "failed (3)" in capsys.readouterr().out
    assert [c["args"] for c in fake()] == ["-d"], "nothing to quit after a failed start"
    with pytest.raises(MpsUnavailable):
        with mps_daemon("on", tmp_path, "cuda", 2):
            pass


def test_setting_is_checked():
    with pytest.raises(ValueError, match="mps must be one of"):
        wanted("yes", "cuda", 2)
    with pytest.raises(ValueError, match="mps must be one of"):
        OnOffConfig(mps="yes")
    assert OnOffConfig().mps == "auto"


def test_tile_choices_follow_shapes_not_the_visible_sms(monkeypatch):
    """Under a capped MPS share a process sees fewer SMs (25% of an H200: 32). Every tile and split-K choice is
    sized for PINNED_SMS, so it is the same at any visible count; the control: the same rule sized for the visible
    count (as before the pin) picks other tiles for the Qwen3-1.7B shape's decode products."""
    import torch

    from workbench.kernels import matmul as mm
    from workbench.kernels import matmul_tiles as mt

    monkeypatch.setattr(mt, "interpreting", lambda: False)
    monkeypatch.setattr(mm, "interpreting", lambda: False)
    monkeypatch.setattr(mt, "_capability", lambda index: (9, 0))
    dev = torch.device("cuda", 0)
    shapes = [(m, n, k) for m in (1, 32, 33, 64, 100, 128, 200, 256, 512, 4096, 65536)
              for n, k in ((4096, 2048), (2048, 2048), (2048, 6144), (1024, 2048), (151936, 2048), (576, 576),
                           (16, 4096), (12288, 2048))]

    def choices():
        return ([mt.matmul_config(m, torch.bfloat16, dev, n, k) for m, n, k in shapes]
                + [mm.split_k_splits(m, n, k, dev) for m, n, k in ((16, 2048, 1 << 16), (2048, 16, 1 << 16))])

    seen = {}
    for sms in (132, 114, 66, 33, 32, 16):
        monkeypatch.setattr(mt, "_num_sms", lambda index, s=sms: s)
        seen[sms] = choices()
    assert all(c == seen[132] for c in seen.values()), [s for s, c in seen.items() if c != seen[132]]
    bucket = dict(mt.MATMUL_BUCKETS)[256]
    unpinned = [(m, n, k) for m, n, k in shapes if 33 <= m <= 256
                and mt._hopper_bf16(m, n, k, bucket, 32) != mt._hopper_bf16(m, n, k, bucket, mt.PINNED_SMS)]
    assert unpinned, "the control: sized for 32 SMs, some decode product would take other tiles"

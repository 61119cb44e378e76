"""One folder, one run (issue 63): every command that writes a run refuses a folder another process holds, one that
holds a run (unless resumed), the user's own config.yaml and an empty name, each in one line, changing nothing; a
Ctrl-C checkpoints at the step's end; a finished run resumed has nothing to do."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import workbench.rl.trainer as trainer
from workbench.__main__ import main
from workbench.nightly import NightlyConfig, grid_folder, notebook_grid, notebook_paths
from workbench.rundir import LOCK, claim, start_over

ROOT = Path(__file__).resolve().parents[1]
_HOLD = ("import sys\nfrom workbench.rundir import claim\nwith claim(sys.argv[1], 'holder'):\n"
         "    print('held', flush=True)\n    sys.stdin.read()\n")
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "2", "--kernel-mode", "standard",
         "--no-progress"]


def _env() -> dict:
    # this checkout first; the rest of the path kept (conftest.py's tests/subprocess_site, for the interpreter)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _holder(folder: Path) -> subprocess.Popen:
    """Another process holding `folder` through the same function the commands use, until its stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _tree(folder: Path) -> dict:
    """Every file below `folder` and its bytes' hash: what "nothing changed" compares."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def _nightly_grid(out: Path) -> Path:
    return grid_folder(NightlyConfig(out_root=str(out)), notebook_grid(("smoke=True",),
                                                                      notebook_paths(ROOT / "notebooks", ("01",))))


COMMANDS = {
    "train": lambda d: ["train", "--out-dir", str(d), "--steps", "1", *SMALL],
    "on-off": lambda d: ["on-off", "--out-dir", str(d), "--smoke"],
    "sweep": lambda d: ["sweep", "train", "seed=0", "steps=1", "--out-root", str(d)],
    "train-policy": lambda d: ["train-policy", "--out", str(d), "--max-steps", "1"],
    "warm-start": lambda d: ["warm-start", "--out", str(d), "--steps", "1"],
    "nightly": lambda d: ["nightly", "--out-root", str(d.parent), "--only", "01", "--grid", "smoke=True",
                          "--notebooks-dir", str(ROOT / "notebooks")],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_folder_another_process_holds_is_refused_in_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _nightly_grid(tmp_path / "nightly") if command == "nightly" else tmp_path / "run"
    folder.mkdir(parents=True)
    (folder / "theirs.txt").write_text("the first process's")
    holder = _holder(folder)
    try:
        assert main(COMMANDS[command](folder)) == 2
        line = _one_line(capsys)
        assert f"{folder} is in use by holder (pid {holder.pid} on " in line, line
        assert _tree(folder) == {"theirs.txt": hashlib.sha256(b"the first process's").hexdigest(), LOCK: _tree(
            folder)[LOCK]}, "the refused process wrote nothing"
    finally:
        holder.stdin.close()
        assert holder.wait(30) == 0
        holder.stdout.close()
    assert not (folder / LOCK).exists(), "a holder that ends releases the folder"


@pytest.mark.slow
def test_two_real_train_processes_into_one_folder(policy, tmp_path):
    """The issue's case: a second `train` with another learning rate into the folder of one still running is refused
    in one line; the first, interrupted (SIGINT, as a terminal's Ctrl-C), checkpoints its step and says how to go on;
    resumed with no steps left it has nothing to do."""
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "workbench", "train", "--policy", policy, "--out-dir", str(out), "--steps", "500",
            "--checkpoint-every", "100", *SMALL]
    first = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        # Step 1's rows in the metrics: the run is well under way (the log may exist, empty, from the setup on).
        while not (out / "metrics.csv").exists() or "\n1," not in (out / "metrics.csv").read_text():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        config = (out / "config.yaml").read_text()
        second = subprocess.run([*argv, "--lr", "1e-3"], env=_env(), capture_output=True, text=True, timeout=300)
        err = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(err) == 1 and f"is in use by train (pid {first.pid} on" in err[0], err
        assert (out / "config.yaml").read_text() == config, "the refused process wrote nothing"
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 130, err
    found = re.search(r"interrupted; the last good checkpoint \(step (\d+)\)", err)
    assert found, err
    at = int(found.group(1))
    assert 0 < at < 100 and "--resume" in err, "checkpointed at the step the Ctrl-C came in, not at step 100"
    done = subprocess.run([sys.executable, "-m", "workbench", "train", "--config", str(out / "config.yaml"),
                           "--resume", "--steps", str(at)], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"nothing to do: the run is at step {at}" in done.stdout, done.stderr


def test_a_killed_holders_lock_is_taken_over_with_a_notice(tmp_path, capsys):
    holder = _holder(tmp_path / "run")
    holder.kill()
    holder.wait(30)
    holder.stdin.close()
    holder.stdout.close()
    assert (tmp_path / "run" / LOCK).exists(), "a killed holder leaves its record"
    with claim(tmp_path / "run", "second"):
        line = _one_line(capsys)
        assert f"taking over the lock left by holder (pid {holder.pid} on" in line, line
        second = _holder_attempt(tmp_path / "run")
        assert second.returncode == 1 and "is in use by second (pid" in second.stderr, second.stderr
    assert not (tmp_path / "run" / LOCK).exists()


def test_without_flock_the_record_decides(tmp_path, capsys, monkeypatch):
    """A file system without flock (ENOLCK): a live holder on this host keeps the folder, a dead one's is taken."""
    import errno
    import json
    import socket

    import workbench.rundir as rundir

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir.fcntl, "flock", no_flock)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid, refused in ((sleeper.pid, True), (_dead_pid(), False)):
            (tmp_path / LOCK).write_text(json.dumps({"command": "holder", "pid": pid, "host": socket.gethostname(),
                                                     "started": "then"}))
            if refused:
                with pytest.raises(ValueError, match=f"is in use by holder \\(pid {pid} on"), claim(tmp_path, "x"):
                    pass
            else:
                with claim(tmp_path, "x"):
                    assert f"taking over the lock left by holder (pid {pid} on" in _one_line(capsys)
    finally:
        sleeper.kill()
        sleeper.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def _holder_attempt(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _HOLD, str(folder)], input="", capture_output=True, text=True,
                          env=_env(), timeout=60)


def test_a_failed_claim_in_a_new_folder_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), claim(tmp_path / "new", "x"):
        raise RuntimeError
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("found", ["metrics.csv", "config.yaml", "checkpoints"])
def test_train_refuses_a_folder_holding_a_run_unless_resumed(found, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    if found == "checkpoints":
        (out / found).mkdir()
    else:
        (out / found).write_text("# TrainConfig: the resolved settings of this run\nlr: 1.0e-05\n")
    before = _tree(out)
    assert main(COMMANDS["train"](out)) == 2
    line = _one_line(capsys)
    assert f"{out} already holds a run ({found}): continue it with resume=True (--resume)" in line, line
    assert main([*COMMANDS["train"](out), "--resume"]) == 2
    line = _one_line(capsys)
    assert "wrote no checkpoint yet" in line and "delete that folder to start over" in line, line
    assert _tree(out) == before


@pytest.mark.parametrize("command", ["train", "on-off"])
def test_the_users_config_beside_the_run_is_never_overwritten(command, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    mine = "# my settings, with comments\ndevice: cpu  # no GPU here\n"
    (out / "config.yaml").write_text(mine)
    assert main([command, "--config", str(out / "config.yaml"), "--out-dir", str(out)]) == 2
    line = _one_line(capsys)
    assert f"{out / 'config.yaml'} is not a config a run wrote" in line and f"{out}.yaml" in line, line
    assert _tree(out) == {"config.yaml": hashlib.sha256(mine.encode()).hexdigest()}


@pytest.mark.parametrize("argv", [["train", "--out-dir", ""], ["on-off", "--out-dir", "", "--smoke"],
                                  ["train-policy", "--out", ""], ["warm-start", "--out", ""],
                                  ["nightly", "--out-root", "", "--only", "01", "--notebooks-dir",
                                   str(ROOT / "notebooks")], ["compare", "--out-dir", ""],
                                  ["sweep", "train", "seed=0", "--out-root", " "]])
def test_an_empty_output_folder_is_refused(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("the user's")
    assert main(argv) == 2
    assert "the output folder is empty" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"], "nothing written into the current folder"


def test_ctrl_c_checkpoints_at_the_next_step_and_the_run_resumes(policy, tmp_path, capsys, monkeypatch):
    step = trainer.train_step

    def ctrl_c_during_step_2(run, n):
        if n == 2:   # as a terminal's Ctrl-C arrives: a signal in the middle of the step
            os.kill(os.getpid(), signal.SIGINT)
        return step(run, n)

    monkeypatch.setattr(trainer, "train_step", ctrl_c_during_step_2)
    out = tmp_path / "run"
    argv = ["train", "--policy", policy, "--out-dir", str(out), "--steps", "4", "--checkpoint-every", "5", *SMALL]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("interrupt: finishing this step") and len(err) == 2, err
    assert "the last good checkpoint (step 2)" in err[1] and f"--config {out / 'config.yaml'} --resume" in err[1]
    assert set(pd.read_csv(out / "metrics.csv").step) == {1, 2}
    monkeypatch.setattr(trainer, "train_step", step)
    assert main(["train", "--config", str(out / "config.yaml"), "--resume"]) == 0
    assert set(pd.read_csv(out / "metrics.csv").step) == {1, 2, 3, 4}


def test_resuming_a_finished_run_has_nothing_to_do_and_changes_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"   # the self-trained starting policy, as the user ran it
    monkeypatch.setattr("workbench.rl.run.PolicyConfig", _tiny_policy)
    with pytest.warns(UserWarning, match="outside target_accuracy"):   # 2 steps of it: the range is out of reach
        assert main(["train", "--out-dir", str(out), "--steps", "2", *SMALL]) == 0
    capsys.readouterr()
    before = _tree(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}

    def no_training(*a, **k):
        raise AssertionError("a run with nothing to do trained")

    monkeypatch.setattr("workbench.rl.run.train_policy", no_training)
    monkeypatch.setattr(trainer, "train_step", no_training)
    assert main(["train", "--config", str(out / "config.yaml"), "--resume", "--steps", "1"]) == 0
    assert f"nothing to do: the run is at step 2 ({out}, steps=1)" in capsys.readouterr().out
    assert _tree(out) == before and {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def _tiny_policy(**kw):
    from workbench.policies.selftrained import PolicyConfig

    return PolicyConfig(**kw, max_steps=2, eval_every=2, eval_problems=2, batch_size=4)


def test_an_experiment_restarts_its_own_run_that_never_checkpointed(tmp_path):
    run = tmp_path / "on-seed0"
    (run / "policy").mkdir(parents=True)
    for name in ("config.yaml", "metrics.csv"):
        (run / name).write_text("x")
    (run / "keep.txt").write_text("not a run's file")
    start_over(run)
    assert sorted(p.name for p in run.iterdir()) == ["keep.txt"]


def test_a_failed_on_off_report_keeps_the_runs_in_one_line(tmp_path, capsys, monkeypatch):
    import workbench.onoff.publish as publish
    import workbench.onoff.runner as runner

    out = tmp_path / "exp"

    def runs(cfg):   # the finished runs, as run_on_off leaves them
        (out / "on-seed0").mkdir(parents=True)
        (out / "on-seed0" / "metrics.csv").write_text("step,metric,value,variant,seed\n1,reward_mean,0.5,on,0\n")

    def report(out_dir, *a, **k):
        raise pd.errors.EmptyDataError("No columns to parse from file")

    monkeypatch.setattr(runner, "run_on_off", runs)
    monkeypatch.setattr(publish, "report", report)
    assert main(["on-off", "--out-dir", str(out), "--smoke"]) == 2
    line = _one_line(capsys)
    assert f"the runs are kept in {out}, but their report failed (EmptyDataError: No columns" in line, line
    assert (out / "on-seed0" / "metrics.csv").exists() and not (out / LOCK).exists()

"""A CUDA MPS daemon for the runner's worker processes (`OnOffConfig.mps`).

Several small runs on one GPU, each in its own process, are time-sliced by default: one process's kernels at a
time. Under MPS their kernels run side by side (issue 59 measured 4 SmolLM2 runs at 1.85x the aggregate of one
time-sliced, 3.40x under MPS). The daemon is this call's own: its pipe directory (a short private folder under
/tmp: the control socket's path must stay within a Unix socket's ~107 bytes) and its log directory (under the
experiment's out_dir) are set in this process's environment while the block runs, so the workers it spawns
connect to it and no other MPS user is touched; the daemon is quit when the block ends, error or not. No card
setting changes (no `nvidia-smi -c`): MPS clients and other processes share the GPU in its default compute mode.
The runner's own process is no client (it connected to CUDA before, if at all, and runs no kernels meanwhile).

Where the caller runs a daemon already (CUDA_MPS_PIPE_DIRECTORY names a pipe directory holding its control
socket), the workers join it and nothing is started or quit: several runner calls on one GPU (arms of different
lengths or losses in one GPU hold, `scripts/device_onoff.sh STEP=parts`) are then clients of one daemon, as the
runs of one call are, instead of each call starting a daemon of its own beside the others'.

Each client gets the whole GPU (no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is set): a capped share would show the
process fewer SMs, which the kernels' tile choices do not follow (kernels/matmul_tiles.py, `PINNED_SMS`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
SETTINGS = ("auto", "on", "off")
_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
_TIMEOUT_S = 60


class MpsUnavailable(RuntimeError):
    """mps='on' and the daemon cannot run here."""


def wanted(setting: str, device: str, workers: int) -> bool:
    """Whether `setting` asks for MPS for `workers` processes on `device` ('cuda' or 'cpu'): never for one
    process or off a GPU."""
    if setting not in SETTINGS:
        raise ValueError(f"mps must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return setting != "off" and workers > 1 and device == "cuda"


@contextlib.contextmanager
def mps_daemon(setting: str, log_root: str | Path, device: str, workers: int) -> Iterator[bool]:
    """Run the block with an MPS daemon of its own where `setting` asks for one (`wanted`); yields whether it runs.

    A daemon the caller runs (CUDA_MPS_PIPE_DIRECTORY with its control socket) is joined, not started. 'auto' falls
    back to time-slicing with a one-line warning where the control binary is missing or fails to start; 'on' raises
    MpsUnavailable there."""
    if not wanted(setting, device, workers):
        yield False
        return
    outer = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if outer and (Path(outer) / "control").exists():
        print(f"MPS: the {workers} workers join the running daemon of {outer} (CUDA_MPS_PIPE_DIRECTORY)", flush=True)
        yield True
        return
    binary = shutil.which(CONTROL)
    problem = None if binary else f"{CONTROL} is not on PATH"
    pipe = Path(tempfile.mkdtemp(prefix="wb-mps-", dir="/tmp"))
    log = Path(log_root) / "mps-log"
    log.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    if binary:
        started = subprocess.run([binary, "-d"], env=env, capture_output=True, text=True, timeout=_TIMEOUT_S)
        if started.returncode:
            problem = f"{CONTROL} -d failed ({started.returncode}): {(started.stderr or started.stdout).strip()[:200]}"
    if problem:
        shutil.rmtree(pipe, ignore_errors=True)
        if setting == "on":
            raise MpsUnavailable(f"mps='on': {problem}; install the CUDA MPS tools or set mps='auto' or 'off'")
        print(f"warning: {problem}: the {workers} workers share the GPU time-sliced (mps='off' silences this)",
              flush=True)
        yield False
        return
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update({k: env[k] for k in _ENV})
    try:
        yield True
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            done = subprocess.run([binary], input="quit\n", env=env, capture_output=True, text=True,
                                  timeout=_TIMEOUT_S)
            failed = done.returncode and f"({done.returncode}): {(done.stderr or done.stdout).strip()[:200]}"
        except subprocess.TimeoutExpired:
            failed = f"(no answer in {_TIMEOUT_S} s)"
        if failed:
            print(f"warning: quitting the MPS daemon of pipe directory {pipe} failed {failed}", flush=True)
        else:
            shutil.rmtree(pipe, ignore_errors=True)

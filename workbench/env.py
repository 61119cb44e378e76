"""What a run ran on. Bitwise results hold per (GPU, torch, triton, kernel configs),
so every run can record exactly that."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without a GPU is an error."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU here; use 'cpu' or 'auto'")
    return device


def placed(device: str | torch.device) -> str:
    """`device` with its GPU named: safetensors reads a bare 'cuda' as cuda:0, torch as the current GPU (under
    torchrun each rank's own, set by `launch.init`), so a reader told 'cuda' would put every rank's tensors on GPU 0."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def git_sha(cwd: str | Path | None = None) -> str:
    """The checkout's commit (with '-dirty' if it has uncommitted changes), or 'unknown'.

    A copy of the tree without .git (a GPU host) can be told its commit through WORKBENCH_GIT_SHA.
    """
    if os.environ.get("WORKBENCH_GIT_SHA"):
        return os.environ["WORKBENCH_GIT_SHA"]
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment_record() -> dict:
    """Versions, device and kernel configs, as one JSON-able dict."""
    from . import __version__
    from .kernels import REGISTRY
    from .kernels.runtime import interpreting

    cuda = torch.cuda.is_available()
    return {
        "workbench": __version__,
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_capability": list(torch.cuda.get_device_capability()) if cuda else None,
        "gpu_sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "triton_interpreter": interpreting(),
        "kernel_configs": {name: op.tile_config() for name, op in REGISTRY.items()},
    }

"""Sharded training checkpoints: each rank writes its own shards with torch.distributed.checkpoint (DCP), and a
checkpoint saved by N ranks loads at any world size (DCP reshards on load, so a 2-GPU run resumes on 2 GPUs
bitwise, or in one process for evaluation).

What is saved: the model's and the optimizer's state dicts as DCP's `get_state_dict` gives them (a FSDP2 model's
DTensor shards, each rank's own; plain tensors of a replicated model, written once), and a small `state.json`
(step, weight version, seeds, world size, caller's extras).

Every instant of a save is recoverable, as in `workbench.rl.checkpoint`: a checkpoint is a folder
`root/step-NNNNNN`, written under a temporary name `.step-NNNNNN.tmp` (every rank its shards, fsynced by DCP's
writer), then rank 0 writes `state.json` last, fsyncs it and the folder, renames the folder into place (one atomic
rename) and fsyncs the root; only then are older checkpoints pruned. A folder counts as complete when its
state.json parses, so a save killed anywhere before the rename leaves the previous checkpoint as the newest
complete one, and its leftover temporary folder is removed by the next save. All ranks must see the same
filesystem at `root` (one host, or a shared filesystem across nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..files import fsync_path

STATE = "state.json"
"""Written last into a checkpoint folder: its presence (and parsing) marks the checkpoint complete."""
KEEP = 2
"""Complete checkpoints kept (the newest), so a file damaged after its save still leaves one to resume from."""
_STEP = re.compile(r"step-(\d+)")
_T = TypeVar("_T")


def _step(folder: Path) -> int | None:
    """The step of a complete checkpoint folder (its state.json parses), or None."""
    try:
        return int(json.loads((folder / STATE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoints(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(s, f) for f in root.iterdir() if _STEP.fullmatch(f.name) and (s := _step(f)) is not None]
    return [f for _, f in sorted(found)]


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = checkpoints(root)
    return found[-1] if found else None


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _on_main(fn: Callable[[], _T], group: dist.ProcessGroup | None) -> _T:
    """fn() on the group's first rank; every rank then returns its result, or raises its error (a collective, so it
    also orders the ranks: nothing after it starts before fn has finished)."""
    if not dist.is_initialized():
        return fn()
    main = dist.get_global_rank(group or dist.group.WORLD, 0)
    outcome: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == main:
        try:
            outcome = [("ok", fn())]
        except Exception as e:  # every rank must learn of it, or the others block in their next collective
            error, outcome = e, [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(outcome, src=main, group=group)
    status, value = outcome[0]
    if status == "error":
        if error is not None:
            raise error
        raise RuntimeError(f"rank {main} failed: {value}")
    return value


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group DCP warns that it assumes one process on every save and load: here that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)", category=UserWarning)
        yield


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """DCP's state dicts (a fresh optimizer's state is created first, at zero, so a load has tensors to fill)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _write_state(folder: Path, state: dict) -> None:
    path = folder / STATE
    path.write_text(json.dumps(state, indent=1))
    fsync_path(path)


def _finish(tmp: Path, final: Path, state: dict, keep: int, files: Callable[[Path], None] | None) -> Path:
    """Rank 0, once every rank's shards are in `tmp`: the caller's files, state.json, then the rename into place,
    then the pruning."""
    if files is not None:
        files(tmp)
        for f in tmp.iterdir():
            fsync_path(f)
    _write_state(tmp, state)
    fsync_path(tmp)
    if final.exists():  # the same step saved again (a resumed run repeating its last save): not newer, replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(final.parent)
    for old in checkpoints(final.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for left in final.parent.glob(".step-*.tmp"):  # left by a killed save
        shutil.rmtree(left, ignore_errors=True)
    return final


def save(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         version: int, seeds: dict[str, int] | None = None, extra: dict | None = None, keep: int = KEEP,
         group: dist.ProcessGroup | None = None, files: Callable[[Path], None] | None = None) -> Path:
    """Saves `root/step-NNNNNN` (every rank of `group` calls it): the model's and optimizer's sharded state with
    DCP, then `files(folder)` on the group's first rank (the caller's own files, fsynced with the rest), then
    state.json with step, `version` (the weight version the model holds), `seeds`, the world size and `extra`
    (JSON values). Returns the folder. Any rank's failure is raised on every rank; the previous checkpoint
    then stays the newest complete one."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the checkpoint just written), got {keep}")
    root = Path(root)
    final, tmp = root / f"step-{step:06d}", root / f".step-{step:06d}.tmp"
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    state = {"step": step, "version": version, "seeds": dict(seeds or {}), "world_size": world,
             "format": "torch.distributed.checkpoint", "torch": torch.__version__, "extra": dict(extra or {})}
    json.dumps(state)  # a value JSON cannot hold fails here, on every rank, before any file is written

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    try:
        _on_main(prepare, group)
        with _single_process_quiet():
            dcp.save(_state_dicts(model, optimizer), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                     process_group=group, no_dist=not dist.is_initialized())
        return _on_main(lambda: _finish(tmp, final, state, keep, files), group)
    except OSError as e:
        done = latest(root)
        where = f"the newest complete checkpoint is {done}" if done else "no complete checkpoint exists yet"
        raise OSError(f"step {step}: the checkpoint could not be written to {root} ({e.strerror or e}); {where}. "
                      "Free space or make the folder writable, then resume.") from e


def load(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         group: dist.ProcessGroup | None = None) -> dict:
    """Loads a complete checkpoint folder into `model` (and `optimizer`) in place, at any world size (every rank of
    `group` calls it; one process without a process group loads it whole). Returns its state.json."""
    folder = Path(folder)
    if _step(folder) is None:
        done = latest(folder.parent)
        other = f"the newest complete one is {done}" if done else f"no complete checkpoint is in {folder.parent}"
        raise ValueError(f"{folder} is not a complete checkpoint (no readable {STATE}: missing, or its save was "
                         f"interrupted); {other}")
    state = json.loads((folder / STATE).read_text())
    sds = _state_dicts(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.load(sds, storage_reader=dcp.FileSystemReader(folder), process_group=group,
                     no_dist=not dist.is_initialized())
    except Exception as e:
        raise ValueError(f"{folder} does not fit this model/optimizer ({type(e).__name__}: {e}); load it into the "
                         "model and optimizer it was saved from (same config, same optimizer type)") from e
    if optimizer is None:
        set_model_state_dict(model, sds["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=sds["model"], optim_state_dict=sds["optim"])
    return state

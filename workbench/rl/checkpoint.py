"""Resumable training checkpoints: the trained weights, AdamW's state, the lagged generator's weights,
the config and the metrics so far.

Every instant of a save is recoverable: `checkpoints/step-NNNNNN` is written under a temporary name, fsynced, and
renamed into place (one atomic rename) before older ones are pruned, so a kill leaves the previous checkpoint or the
new one. With LoRA only the adapters are saved (the base is rebuilt and checked by checksum; the folder is also a PEFT
adapter folder). With FSDP2 or tensor parallelism every trainer rank writes its shards through DCP, and a run resumes
at any world size (bitwise at the same one). The files, the lagged generator's versions and the earlier layouts that
still resume: docs/distributed.md, "`workbench/rl/checkpoint.py`: resumable, atomic checkpoints".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pandas as pd
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..distributed.checkpoint import load as load_sharded
from ..distributed.checkpoint import save as save_sharded
from ..config import flat_dict
from ..env import placed
from ..files import fsync_path
from ..models.lora import adapter_state
from ..models.peft import save_adapter
from .config import TrainConfig
from .weights import TrainWeights

# Fields a resumed run may change; any other difference would silently make another run. The micro-batch budget
# changes only the order gradients accumulate in (the log-probs are the same bits), so a run that ran out of
# memory can resume with a smaller one. Like the world size, rollout_ranks only places the work: the samples are the
# same (request ids are the step's rows), so a run may resume colocated or split.
_RESUMABLE_CHANGES = {"steps", "resume", "checkpoint_every", "device", "out_dir", "progress", "tensorboard",
                      "vllm_memory", "max_tokens_per_microbatch", "activation_checkpointing", "time_limit_s",
                      "rollout_ranks"}
KEEP = 2
"""Complete checkpoints kept (the newest), so a file damaged after its save still leaves one to resume from."""
_STEP = re.compile(r"step-(\d+)")


def config_changes(saved: dict, cfg: TrainConfig) -> dict:
    """{field: (saved, now)} for every field a resumed run may not change, by the settings' bare names (`flat_dict`:
    a checkpoint from before TrainConfig had groups compares as well). A field the saved config lacks (a
    checkpoint from before that field existed) counts as its default."""
    def plain(v):  # as JSON holds it
        return list(v) if isinstance(v, tuple) else v

    defaults = flat_dict(TrainConfig())
    return {k: (saved.get(k, defaults[k]), v) for k, v in flat_dict(cfg).items()
            if k not in _RESUMABLE_CHANGES and plain(saved.get(k, defaults[k])) != plain(v)}


def _complete(folder: Path) -> int | None:
    """The step of a complete checkpoint folder (its state.json, written last, parses), or None."""
    try:
        return int(json.loads((folder / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoints(out: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (the earlier layout's folders before the current ones)."""
    found = []
    root = out / "checkpoints"
    if root.is_dir():
        for folder in root.iterdir():
            if _STEP.fullmatch(folder.name) and (step := _complete(folder)) is not None:
                found.append((step, 1, folder))
    for legacy in (out / "checkpoint", out / ".checkpoint-old"):
        if (step := _complete(legacy)) is not None:
            found.append((step, 0, legacy))
    return [f for *_, f in sorted(found)]


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint of the run in `out`, or None."""
    found = checkpoints(out)
    return found[-1] if found else None


def last_good(out: Path) -> str:
    """Where the last good checkpoint is, for error messages."""
    folder = latest_checkpoint(out)
    if folder is None:
        return "no checkpoint was written yet"
    return f"the last good checkpoint (step {_complete(folder)}) is in {folder}"


def save_checkpoint(out: Path, step: int, weights: TrainWeights, metrics: pd.DataFrame, cfg: TrainConfig,
                    lagged: list[tuple[int, dict]] | None) -> Path:
    root = out / "checkpoints"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return _save(root, out, step, weights, metrics, cfg, lagged)
    except OSError as e:
        raise OSError(f"step {step}: the checkpoint could not be written to {root} ({e.strerror or e}); "
                      f"{last_good(out)}. Free space or make the folder writable, then resume.") from e


def save_sharded_checkpoint(out: Path, step: int, weights: TrainWeights, metrics: pd.DataFrame, cfg: TrainConfig,
                            lagged: list[tuple[int, dict]] | None) -> Path:
    """FSDP2 or tensor parallel (`weights.dcp`): every trainer rank calls it; each writes its shards (DCP), rank 0
    the metrics and lagged weights."""
    def files(folder: Path) -> None:
        metrics.to_csv(folder / "metrics.csv", index=False)
        _save_lagged(folder, lagged)

    extra = {"config": flat_dict(cfg), **_lagged_state(lagged)}
    module, group = weights.dcp
    return save_sharded(out / "checkpoints", step, module, weights.opt, version=step, extra=extra, keep=KEEP,
                        group=group, files=files)


def _save(root: Path, out: Path, step: int, weights: TrainWeights, metrics: pd.DataFrame, cfg: TrainConfig,
          lagged: list[tuple[int, dict]] | None) -> Path:
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in weights.masters.items()}, tmp / "masters.safetensors")
    state = weights.opt.state_dict()
    tensors = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    _save_lagged(tmp, lagged)
    extra = _lagged_state(lagged)
    if weights.lora is not None:
        save_adapter(tmp, weights.lora, adapter_state(weights.model), base_model=cfg.policy)
        extra["base_checksum"] = weights.base_checksum()
    metrics.to_csv(tmp / "metrics.csv", index=False)
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": flat_dict(cfg),
                                                "param_groups": state["param_groups"], **extra}, indent=1))
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)
    if final.exists():  # the same step saved again (a resumed run repeating its last save): not newer, replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    steps = sorted((int(m.group(1)), f) for f in root.iterdir() if (m := _STEP.fullmatch(f.name)))
    for _, old in steps[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    for f in root.glob(".step-*.tmp"):  # left by a killed save
        shutil.rmtree(f, ignore_errors=True)
    for legacy in (out / "checkpoint", out / ".checkpoint-old"):
        shutil.rmtree(legacy, ignore_errors=True)
    return final


def _lagged_files(n: int) -> list[str]:
    return ["generator.safetensors"] + [f"generator-{i}.safetensors" for i in range(1, n)]


def _save_lagged(folder: Path, lagged: list[tuple[int, dict]] | None) -> None:
    for name, (_, weights) in zip(_lagged_files(len(lagged or [])), lagged or []):
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / name)


def _lagged_state(lagged: list[tuple[int, dict]] | None) -> dict:
    """state.json's fields for the lagged versions (`generator_version`, the generator's own, as before k > 1)."""
    if not lagged:
        return {"generator_version": None}
    return {"generator_version": lagged[0][0], "generator_versions": [v for v, _ in lagged]}


def _read(path: Path, older: list[Path], **kw) -> dict:
    try:
        return load_file(path, **kw)
    except (SafetensorError, OSError, ValueError) as e:
        other = f"the previous checkpoint is {older[-1]}: remove {path.parent} to resume from it" if older \
            else "no older checkpoint is left: start a new run"
        raise ValueError(f"resume: {path} is damaged or truncated ({e}); {other}") from e


def load_checkpoint(out: Path, weights: TrainWeights, cfg: TrainConfig, device: str):
    """Restores the weights and AdamW in place from the newest complete checkpoint; returns (step, metrics so far,
    lagged generator weights). A damaged file is an error naming it and the checkpoint before it."""
    *older, ck = checkpoints(out) or [None]
    if ck is None:
        raise FileNotFoundError(f"resume: no checkpoint in {out / 'checkpoints'}; run without resume first")
    state = json.loads((ck / "state.json").read_text())
    if state.get("format") == "torch.distributed.checkpoint":   # FSDP2's: the run's fields are its extras
        state = {**state["extra"], "step": state["step"]}
    changed = config_changes(state["config"], cfg)
    if changed:
        raise ValueError(f"resume: the config differs from the checkpoint's in {changed} (saved, now); "
                         "resume with the same settings or start a new out_dir")
    if weights.lora is not None and state.get("base_checksum") != weights.base_checksum():
        raise ValueError(f"resume: the frozen base differs from the one {ck} trained its adapters on; resume from "
                         "the same starting policy (policy=...), or start a new out_dir")
    if weights.dcp is not None:   # the same config: a DCP checkpoint (DCP reshards to this world size)
        module, group = weights.dcp
        load_sharded(ck, module, weights.opt, group=group)
        weights.sync_model()
    else:
        _load_whole(ck, older, state, weights)
    lagged = None
    if state.get("generator_version") is not None:   # a checkpoint of before k > 1 names one version
        versions = state.get("generator_versions", [state["generator_version"]])
        lagged = [(v, _read(ck / name, older, device=placed(device)))
                  for v, name in zip(versions, _lagged_files(len(versions)))]
    metrics = pd.read_csv(ck / "metrics.csv")
    return state["step"], metrics, lagged


def _load_whole(ck: Path, older: list[Path], state: dict, weights: TrainWeights) -> None:
    """The one-process format: the masters and AdamW's state into `weights`, in place."""
    saved = _read(ck / "masters.safetensors", older)
    wanted = {k: tuple(v.shape) for k, v in weights.masters.items()}
    found = {k: tuple(v.shape) for k, v in saved.items()}
    if found != wanted:
        diff = sorted(set(wanted) ^ set(found)) or [k for k in wanted if wanted[k] != found[k]]
        raise ValueError(f"resume: {ck / 'masters.safetensors'} holds another model's weights (first differences: "
                         f"{diff[:3]}); resume with the policy this run started from, or start a new out_dir")
    with torch.no_grad():
        for k, v in weights.masters.items():
            v.copy_(saved[k])
    weights.sync_model()
    tensors = _read(ck / "optimizer.safetensors", older)  # load_state_dict moves them to the parameters' device
    opt_state = {"param_groups": state["param_groups"], "state": {}}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        opt_state["state"].setdefault(int(i), {})[name] = v
    weights.opt.load_state_dict(opt_state)

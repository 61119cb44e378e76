"""Resumable training checkpoints: the trained weights, AdamW's state, the lagged generator's weights,
the config and the metrics so far, written atomically (a crash keeps the previous checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file, save_file

from .config import TrainConfig
from .weights import TrainWeights

# Fields a resumed run may change; any other difference would silently make another run. The micro-batch budget
# changes only the order gradients accumulate in (the log-probs are the same bits), so a run that ran out of
# memory can resume with a smaller one.
_RESUMABLE_CHANGES = {"steps", "resume", "checkpoint_every", "device", "out_dir", "progress", "tensorboard",
                      "vllm_memory", "max_tokens_per_microbatch", "activation_checkpointing"}


def config_changes(saved: dict, cfg: TrainConfig) -> dict:
    """{field: (saved, now)} for every field a resumed run may not change. A field the saved config
    lacks (a checkpoint from before that field existed) counts as its default."""
    defaults = asdict(TrainConfig())
    return {k: (saved.get(k, defaults[k]), v) for k, v in asdict(cfg).items()
            if k not in _RESUMABLE_CHANGES and saved.get(k, defaults[k]) != (list(v) if isinstance(v, tuple) else v)}


def last_good(out: Path) -> str:
    """Where the last good checkpoint is, for error messages."""
    state = out / "checkpoint" / "state.json"
    if not state.exists():
        return "no checkpoint was written yet"
    return f"the last good checkpoint (step {json.loads(state.read_text())['step']}) is in {out / 'checkpoint'}"


def save_checkpoint(out: Path, step: int, weights: TrainWeights, metrics: pd.DataFrame, cfg: TrainConfig,
                    lagged: tuple[int, dict] | None) -> None:
    tmp = out / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in weights.masters.items()}, tmp / "masters.safetensors")
    state = weights.opt.state_dict()
    tensors = {f"{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if torch.is_tensor(v)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "optimizer.safetensors")
    if lagged is not None:
        save_file({k: v.contiguous() for k, v in lagged[1].items()}, tmp / "generator.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": asdict(cfg),
                                                "generator_version": None if lagged is None else lagged[0],
                                                "param_groups": state["param_groups"]}, indent=1))
    metrics.to_csv(tmp / "metrics.csv", index=False)
    final = out / "checkpoint"
    old = out / ".checkpoint-old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(out: Path, weights: TrainWeights, cfg: TrainConfig, device: str):
    """Restores the weights and AdamW in place; returns (step, metrics so far, lagged generator weights)."""
    ck = out / "checkpoint"
    if not (ck / "state.json").exists():
        raise FileNotFoundError(f"resume: no checkpoint in {ck}; run without resume first")
    state = json.loads((ck / "state.json").read_text())
    changed = config_changes(state["config"], cfg)
    if changed:
        raise ValueError(f"resume: the config differs from the checkpoint's in {changed} (saved, now); "
                         "resume with the same settings or start a new out_dir")
    saved = load_file(ck / "masters.safetensors")
    with torch.no_grad():
        for k, v in weights.masters.items():
            v.copy_(saved[k])
    weights.sync_model()
    tensors = load_file(ck / "optimizer.safetensors")  # load_state_dict moves them to the parameters' device
    opt_state = {"param_groups": state["param_groups"], "state": {}}
    for key, v in tensors.items():
        i, name = key.split(".", 1)
        opt_state["state"].setdefault(int(i), {})[name] = v
    weights.opt.load_state_dict(opt_state)
    lagged = None
    if state.get("generator_version") is not None:
        lagged = (state["generator_version"], load_file(ck / "generator.safetensors", device=device))
    return state["step"], pd.read_csv(ck / "metrics.csv"), lagged

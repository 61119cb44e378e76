"""LoRA adapters in PEFT's file format, and merging them into a full checkpoint.

A PEFT adapter folder holds `adapter_config.json` (`peft_type` LORA, `task_type` CAUSAL_LM, `r`,
`lora_alpha`, `target_modules`, `base_model_name_or_path`) and `adapter_model.safetensors`, whose names are
PEFT's for a causal LM: `base_model.model.model.layers.3.mlp.up_proj.lora_A.weight` for the model's
`model.layers.3.mlp.up_proj.lora_A`. `peft.PeftModel.from_pretrained(transformers_model, folder)` loads what
`save_adapter` writes, and `read_adapter` reads what PEFT writes for the plain LoRA this model runs; variants it
does not run (rsLoRA's scale, DoRA, biases, per-layer ranks, extra trained modules) are refused by name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..env import placed
from .checkpoint import CheckpointError, checkpoint_dtype, load_pretrained, save_pretrained
from .lora import PROJECTIONS, LoraConfig, attach, copy_adapters, merge

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX, _SUFFIX = "base_model.model.", ".weight"
# PEFT config fields whose non-default values change the function the adapters compute: refused, never ignored.
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
                "modules_to_save": None, "layers_to_transform": None, "fan_in_fan_out": False, "lora_bias": False,
                "target_parameters": None, "layer_replication": None, "trainable_token_indices": None}


def to_peft_name(name: str) -> str:
    """'model.layers.0.self_attn.q_proj.lora_A' -> 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'."""
    return f"{_PREFIX}{name}{_SUFFIX}"


def from_peft_name(name: str) -> str:
    """PEFT's tensor name -> the model's (the inverse of `to_peft_name`)."""
    if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
        raise CheckpointError(f"{name!r} is not a PEFT LoRA tensor name of a causal LM "
                              f"({_PREFIX}...lora_A{_SUFFIX})")
    return name[len(_PREFIX): -len(_SUFFIX)]


def save_adapter(path: str | os.PathLike, cfg: LoraConfig, adapters: dict[str, torch.Tensor],
                 base_model: str = "") -> Path:
    """Write `adapters` ({model name: tensor}, saved in their dtype) and their config as a PEFT folder, atomically
    (a crash leaves the previous files whole)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": cfg.rank, "lora_alpha": cfg.alpha, "target_modules": list(cfg.targets), "lora_dropout": 0.0,
              "init_lora_weights": True, "inference_mode": True, "revision": None, **_UNSUPPORTED}
    tensors = {to_peft_name(k): v.detach().contiguous().cpu() for k, v in adapters.items()}
    with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        for name in (WEIGHTS, CONFIG):
            os.replace(os.path.join(tmp, name), path / name)
    return path


def read_adapter_config(path: str | os.PathLike) -> LoraConfig:
    """The LoRA settings of a PEFT folder's adapter_config.json; what this model cannot run is an error naming it."""
    file = Path(path) / CONFIG
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {CONFIG}; give a PEFT adapter folder (with {CONFIG} and "
                              f"{WEIGHTS})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if raw.get("peft_type") != "LORA":
        raise CheckpointError(f"{file}: peft_type is {raw.get('peft_type')!r}; only LORA adapters are read")
    for key, default in _UNSUPPORTED.items():
        if raw.get(key) not in (default, None):
            raise CheckpointError(f"{file}: {key}={raw[key]!r} is not supported (plain LoRA only: {key}={default!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise CheckpointError(f"{file}: target_modules must be a list of projection names among "
                              f"{', '.join(PROJECTIONS)}, got {targets!r}")
    try:
        return LoraConfig(int(raw["r"]), float(raw["lora_alpha"]), tuple(targets))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from None


def read_adapter(path: str | os.PathLike, device: str | torch.device = "cpu"
                 ) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """(settings, {model name: tensor in the file's dtype}) of a PEFT adapter folder."""
    cfg = read_adapter_config(path)
    file = Path(path) / WEIGHTS
    try:
        tensors = load_file(file, device=placed(device))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: missing, corrupt or unreadable safetensors file ({e})") from None
    return cfg, {from_peft_name(k): v for k, v in tensors.items()}


def load_adapter(path: str | os.PathLike, model: torch.nn.Module) -> LoraConfig:
    """Attach a PEFT folder's adapters to `model` (or fill the ones attached with the same settings), in place."""
    cfg, tensors = read_adapter(path)
    if model.lora is None:
        attach(model, cfg)
    elif model.lora != cfg:
        raise ValueError(f"{path}: the adapters' settings {cfg} differ from the model's {model.lora}")
    try:
        copy_adapters(tensors, model)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    return cfg


@dataclass(frozen=True)
class MergeConfig:
    base: str = ""
    """The base model's Hugging Face checkpoint folder."""
    adapter: str = ""
    """The PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    out: str = ""
    """Where the merged Hugging Face checkpoint goes."""

    def __post_init__(self):
        missing = [f"--{k}" for k in ("base", "adapter", "out") if not getattr(self, k)]
        if missing:
            raise ValueError(f"lora-merge needs {', '.join(missing)} (a checkpoint folder, a PEFT adapter folder, "
                             "an output folder)")


def merge_checkpoint(cfg: MergeConfig) -> Path:
    """Fold the adapters into the base: each adapted W becomes W + scale * B @ A (fp32, then the checkpoint's dtype),
    written as a full Hugging Face checkpoint with the base's tokenizer files."""
    base, out = Path(cfg.base), Path(cfg.out)
    dtype = checkpoint_dtype(base)
    # fp32 throughout (the base's and the adapters' values upcast exactly), one cast to the checkpoint's dtype.
    model = load_pretrained(base, dtype=torch.float32)
    load_adapter(cfg.adapter, model)
    merge(model)
    save_pretrained(model.to(dtype), out)
    for f in base.iterdir():  # tokenizer and generation settings travel with the weights
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model.safetensors"):
            shutil.copy2(f, out / f.name)
    return out

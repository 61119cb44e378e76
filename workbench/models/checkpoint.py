"""Hugging Face checkpoints in and out, torchtitan names, and the merged gate_up layout.

Only safetensors are read (never pickle). A directory holds `config.json`,
`model.safetensors` or shards listed in `model.safetensors.index.json`, and
possibly a tokenizer; `save_pretrained` writes one that `transformers` loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .qwen3 import Qwen3Config, Qwen3ForCausalLM, build, copy_weights

_CONFIG_KEYS = [f for f in Qwen3Config.__dataclass_fields__]


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a Qwen3 model; the message says what is wrong and what to do."""


def config_from_hf(hf: dict, where: str = "config.json") -> Qwen3Config:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
        raise CheckpointError(f"{where}: model_type is {model_type!r} (architectures {archs}); "
                              "workbench reads Qwen3 checkpoints only (model_type 'qwen3')")
    # transformers 5 keeps rope_theta inside rope_parameters; 4.x at the top level.
    rope = dict(hf.get("rope_parameters") or {})
    if "rope_theta" not in rope and "rope_theta" in hf:
        rope["rope_theta"] = hf["rope_theta"]
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: RoPE scaling is not supported (got {hf.get('rope_scaling') or rope})")
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{where}: sliding-window attention is not supported")
    optional = ("head_dim", "max_position_embeddings", "rope_theta")
    missing = [k for k in _CONFIG_KEYS if k not in hf and k not in optional]
    if "rope_theta" not in rope:
        missing.append("rope_theta")
    if missing:
        raise CheckpointError(f"{where}: missing Qwen3 fields {missing}")
    values = {k: hf[k] for k in _CONFIG_KEYS if k in hf}
    values["rope_theta"] = rope["rope_theta"]
    values.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    try:
        return Qwen3Config(**values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_to_hf(cfg: Qwen3Config, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **cfg.to_dict(),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_scaling": None,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _resolve(path_or_hub_id: str | os.PathLike) -> Path:
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; give the checkpoint's directory (with config.json)")
        return path
    hub_like = re.fullmatch(r"[\w.-]+/[\w.-]+", str(path_or_hub_id))
    if not hub_like:
        raise CheckpointError(f"no checkpoint directory at {path}; check the path")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_hub_id), allow_patterns=["*.json", "*.safetensors", "*.txt"]))
    except Exception as e:  # offline, unknown repo, no permission: all end here
        raise CheckpointError(
            f"{path_or_hub_id!r} is not a local directory and could not be fetched from the hub ({type(e).__name__}: "
            f"{e}); download the checkpoint where there is a network and pass its directory"
        ) from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in path.iterdir())
        raise CheckpointError(f"{path}: no model.safetensors (or sharded index) found; it holds {found}. "
                              "Only safetensors checkpoints are read (never .bin / pickle)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path}: shard {name} listed in the index is missing")
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
    return tensors


def load_pretrained(path_or_hub_id: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """A Qwen3ForCausalLM from a Hugging Face checkpoint directory (or a hub id where there is a network)."""
    path = _resolve(path_or_hub_id)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    cfg = config_from_hf(hf_cfg, str(cfg_file))
    tensors = _read_tensors(path)
    tensors = {k.removeprefix("_orig_mod."): v for k, v in tensors.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = build(cfg, device="meta", dtype=dtype, seed=None).to_empty(device=device)
    try:
        copy_weights(tensors, model)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    return model.eval()


def save_pretrained(model: Qwen3ForCausalLM, path: str | os.PathLike, tokenizer=None) -> Path:
    """Write config.json and model.safetensors (and the tokenizer, if given) atomically into `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    # Write next to the target, then rename: a crash leaves the old files whole.
    with tempfile.TemporaryDirectory(dir=path, prefix=".tmp-") as tmp:
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config_to_hf(model.config, dtype), f, indent=2)
        for name in ("model.safetensors", "config.json"):
            os.replace(os.path.join(tmp, name), path / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer through `transformers.AutoTokenizer` (local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: no tokenizer could be loaded ({e})") from None


_TITAN_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TITAN_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"(model\.)?layers\.(\d+)\.(.+)")


def _rename(state: dict, top: dict, layer: dict, prefix_out: str) -> dict:
    out = {}
    for name, t in state.items():
        if name in top:
            out[top[name]] = t
            continue
        m = _LAYER_RE.fullmatch(name)
        if not m or m.group(3) not in layer:
            raise KeyError(f"no torchtitan/HF name for {name!r}")
        out[f"{prefix_out}layers.{m.group(2)}.{layer[m.group(3)]}"] = t
    return out


def hf_to_titan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen3 names -> torchtitan's (tok_embeddings, layers.N.attention.wq, feed_forward.w1, ...)."""
    return _rename(state, _TITAN_TOP, _TITAN_LAYER, "")


def titan_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan Qwen3 names -> Hugging Face's."""
    return _rename(state, {v: k for k, v in _TITAN_TOP.items()}, {v: k for k, v in _TITAN_LAYER.items()}, "model.")


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[I, H] and [I, H] -> the merged [2I, H] gate_up projection (gate rows first, as vLLM lays it out)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    return torch.cat([gate, up], dim=0)


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged [2I, H] projection -> (gate [I, H], up [I, H])."""
    if gate_up.shape[0] % 2:
        raise ValueError(f"a merged gate_up has an even number of rows, got {gate_up.shape[0]}")
    gate, up = gate_up.chunk(2, dim=0)
    return gate, up


def weights_checksum(state: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's bytes, in name order: equal exactly when the weights are bitwise equal."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

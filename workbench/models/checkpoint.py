"""Hugging Face checkpoints in and out, and the merged gate_up layout.

Only safetensors are read (never pickle). A directory holds `config.json`,
`model.safetensors` or shards listed in `model.safetensors.index.json`, and
possibly a tokenizer; `save_pretrained` writes one that `transformers` loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..env import placed
from .config import FAMILIES, ModelConfig, RopeScaling
from .transformer import CausalLM, build, check_weights

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                  "mistral": "MistralForCausalLM"}
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "rms_norm_eps")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as a supported model; the message says what is wrong and what to do."""


def _family(hf: dict, where: str) -> str:
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    named = [family for family, arch in _ARCHITECTURES.items() if arch in archs]
    # model_type decides the family; architectures may stand in only where model_type is absent. A model_type we
    # do not run beside a class we do is another model under that class's name: its weights would load silently.
    if model_type in FAMILIES and set(named) <= {model_type}:
        return model_type
    if model_type in FAMILIES or (model_type and named):
        raise CheckpointError(f"{where}: model_type {model_type!r} and architectures {archs} disagree; fix "
                              "config.json so both name one model (workbench reads "
                              f"{', '.join(f'{f}/{a}' for f, a in _ARCHITECTURES.items())})")
    if not model_type and len(named) == 1:
        return named[0]
    raise CheckpointError(f"{where}: model_type is {model_type!r} (architectures {archs}); workbench reads "
                          f"the model types {', '.join(FAMILIES)} ({', '.join(_ARCHITECTURES.values())})")


def _rope(hf: dict, where: str) -> tuple[float | None, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's `rope_parameters` or 4.x's `rope_theta` + `rope_scaling`."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise CheckpointError(f"{where}: RoPE scaling {kind!r} is not supported (supported: linear, llama3); "
                              f"got {params}")
    keys = ("factor",) if kind == "linear" else ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise CheckpointError(f"{where}: {kind} RoPE scaling lacks {missing}")
    try:
        return theta, RopeScaling(kind, **{k: params[k] for k in keys})
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """The model config of a Hugging Face `config.json` (model_type qwen3, qwen2, llama or mistral).

    What the model cannot run exactly (sliding-window attention, other activations, biases beyond
    Qwen2's q/k/v, other RoPE scalings) is an error naming the field, never silently ignored.
    """
    family = _family(hf, where)
    theta, scaling = _rope(hf, where)
    missing = [k for k in _SHAPE_KEYS if k not in hf] + (["rope_theta"] if theta is None else [])
    if missing:
        raise CheckpointError(f"{where}: missing {family} fields {missing}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    window = hf.get("sliding_window")
    if (hf.get("use_sliding_window") or (family == "mistral" and window is not None
                                         and window < hf.get("max_position_embeddings", 0))):
        raise CheckpointError(f"{where}: sliding-window attention (window {window}) is not supported")
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=True is not supported")
    if family != "qwen2" and hf.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=True (a bias on o_proj too) is not supported for {family}")
    values = {k: hf[k] for k in _SHAPE_KEYS}
    values.update(model_type=family, rope_theta=theta, rope_scaling=scaling, qk_norm=family == "qwen3",
                  attention_bias=family == "qwen2",
                  head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                  tie_word_embeddings=hf.get("tie_word_embeddings", family != "llama" and family != "mistral"))
    if "max_position_embeddings" in hf:
        values["max_position_embeddings"] = hf["max_position_embeddings"]
    try:
        return ModelConfig(**values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """A `config.json` that transformers loads as the same family (`AutoModelForCausalLM`)."""
    out = {
        "architectures": [_ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        **{k: getattr(cfg, k) for k in _SHAPE_KEYS},
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if cfg.model_type in ("qwen3", "llama"):
        out["attention_bias"] = False
    if cfg.model_type == "llama":
        out["mlp_bias"] = False
    if cfg.model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if cfg.model_type == "mistral":
        out["sliding_window"] = None
    return out


def _resolve(path: str | os.PathLike) -> Path:
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise CheckpointError(f"{folder} is a file; give the checkpoint's directory (with config.json)")
    raise CheckpointError(f"no checkpoint directory at {folder}; check the path, or get a model by name or hub id "
                          "first (`python -m workbench fetch-model NAME`, or workbench.models.resolve_model)")


def _shards(path: Path) -> list[Path]:
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
    for name in files:
        if not (path / name).exists():
            raise CheckpointError(f"{path}: shard {name} listed in the index is missing")
    return [path / name for name in files]


def _read_tensors(files: list[Path], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Every tensor, read straight onto `device` and cast there, one at a time (peak: the model plus one
    tensor in the file's dtype). The cast is `Tensor.to`: round to nearest even, as `copy_weights`."""
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt", device=placed(device)) as fh:
                for name in fh.keys():
                    t = fh.get_tensor(name)
                    tensors[name.removeprefix("_orig_mod.")] = t.to(dtype) if t.is_floating_point() else t
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
    return tensors


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The model config of a checkpoint directory's config.json."""
    path = _resolve(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint directory?")
    try:
        hf_cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from None
    return config_from_hf(hf_cfg, str(cfg_file))


def checkpoint_dtype(path: str | os.PathLike) -> torch.dtype:
    """The dtype a checkpoint declares (config.json's `dtype` or `torch_dtype`; float32 where it names none)."""
    file = _resolve(path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: no readable config.json ({e}); is this a Hugging Face checkpoint?") from None
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{path}/config.json: dtype {name!r} is not a floating-point torch dtype")
    return dtype


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu") -> CausalLM:
    """A CausalLM from a Hugging Face checkpoint directory (safetensors, single or sharded).

    The tensors are read onto `device`, cast there, and become the parameters (no second copy).
    """
    path = _resolve(path)
    cfg = read_config(path)
    tensors = _read_tensors(_shards(path), dtype, device)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name in [k for k in tensors if k.endswith("rotary_emb.inv_freq")]:  # older transformers saved these
        del tensors[name]
    model = build(cfg, device="meta", dtype=dtype, seed=None)
    try:
        check_weights(tensors, model)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    model.load_state_dict(tensors, assign=True)
    return model.pack().eval()


def save_pretrained(model: CausalLM, path: str | os.PathLike, tokenizer=None) -> Path:
    """Write config.json and model.safetensors (and the tokenizer, if given) atomically into `path`."""
    if model.lora is not None:
        raise ValueError("the model has LoRA adapters attached, which a Hugging Face checkpoint has no names for: "
                         "save them with models.peft.save_adapter (and the base without them), or fold them in "
                         "first (models.lora.merge)")
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
        if tokenizer.eos_token_id is not None:  # so that transformers' generate stops where ours does
            (path / "generation_config.json").write_text(json.dumps(
                {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
                 "pad_token_id": tokenizer.pad_token_id}, indent=2))
    return path


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


def weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], group_bytes: int = 256 * 2**20) -> bool:
    """Whether two {name: tensor} hold the same names, shapes, dtypes and bytes, compared where the tensors are
    (no host copy, unlike `weights_checksum`). Tensors of one dtype are flattened and compared in concatenated
    groups of up to `group_bytes`, so a few hundred adapters cost a few kernels and one host sync, not one each."""
    if a.keys() != b.keys():
        return False
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    size = 0

    def same() -> bool:
        x, y = (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
        # Bytes, not values: -0.0 == 0.0 and NaN != NaN as numbers, but not as bits.
        return torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    for name in sorted(a):
        x, y = a[name].detach(), b[name].detach()
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        if xs and (size + x.nbytes > group_bytes or x.dtype != xs[0].dtype or x.device != xs[0].device):
            if not same():
                return False
            xs, ys, size = [], [], 0
        xs.append(x.reshape(-1))
        ys.append(y.reshape(-1))
        size += x.nbytes
    return not xs or same()

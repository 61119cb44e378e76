"""Weights between the workbench's model (Hugging Face names) and torchtitan's (its names and layouts), in memory and
as torchtitan's DCP checkpoints.

The names: `hf_to_titan` and `titan_to_hf`, from the tables below. Two layouts differ beyond names, and both moves
are exact (bits kept):
- Llama 3 in torchtitan rotates interleaved pairs, so its wq/wk hold each head's rows in the order HF's
  conversion script permutes them to (torchtitan's `Llama3StateDictAdapter` does the same); Qwen3 keeps HF's rows.
- A tied head: torchtitan's model has `output.weight` as the embedding's tensor (both names in its state dict);
  the workbench's has only the embedding.
A vLLM-style merged `mlp.gate_up_proj.weight` (gate rows first) is split into torchtitan's w1 and w3.

torchtitan's `CheckpointManager` writes a DCP folder (`step-N`) whose top-level keys are the model's own names,
flattened beside 'optimizer', 'lr_scheduler', 'dataloader' and 'train_state' (`_flattened_model_states_sd`;
a model-only save holds the model's names alone); `load_dcp` reads just the model's.
"""

from __future__ import annotations

import os
import re

import torch

from ..models import ModelConfig, build, split_gate_up

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


_GATE_UP = re.compile(r"(.*layers\.\d+\.mlp\.)gate_up_proj\.weight")
_QK = re.compile(r"layers\.\d+\.attention\.w[qk]\.weight")


def _interleaved(cfg: ModelConfig) -> bool:
    """Whether torchtitan's model of this family rotates interleaved pairs (its Llama 3, for llama and mistral)."""
    return cfg.model_type != "qwen3"


def qk_rows(w: torch.Tensor, head_dim: int, to_interleaved: bool) -> torch.Tensor:
    """Each head's rows of a q/k weight [heads * D, K] from HF's halves order (pairs i, i + D/2) to interleaved
    (2i, 2i + 1), or back: a contiguous copy."""
    order = (2, head_dim // 2) if to_interleaved else (head_dim // 2, 2)
    return w.reshape(-1, *order, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def _permute_qk(state: dict[str, torch.Tensor], cfg: ModelConfig, to_interleaved: bool) -> dict[str, torch.Tensor]:
    """`qk_rows` on every q/k weight of `state`."""
    return {k: qk_rows(w, cfg.head_dim, to_interleaved) if _QK.fullmatch(k) else w for k, w in state.items()}


def to_titan(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The workbench's (or a Hugging Face) state dict of `cfg` -> torchtitan's names and layouts."""
    state = dict(state)
    for name in [k for k in state if _GATE_UP.fullmatch(k)]:
        prefix = _GATE_UP.fullmatch(name).group(1)
        state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = split_gate_up(state.pop(name))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out = hf_to_titan(state)
    if cfg.tie_word_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return _permute_qk(out, cfg, to_interleaved=True) if _interleaved(cfg) else out


def from_titan(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """torchtitan's state dict of `cfg` -> the workbench's names and layouts (a tied head: the embedding only)."""
    state = _permute_qk(state, cfg, to_interleaved=False) if _interleaved(cfg) else dict(state)
    if cfg.tie_word_embeddings:
        state.pop("output.weight", None)
    return titan_to_hf(state)


def load_dcp(path: str | os.PathLike, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model weights of a torchtitan DCP checkpoint folder (a `step-N`), as the workbench's state dict on the
    CPU in the checkpoint's dtypes (`models.copy_weights` casts them into a model)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(os.fspath(path))
    try:
        meta = reader.read_metadata().state_dict_metadata
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"{path}: not a DCP checkpoint folder ({e}); give torchtitan's step-N folder") from None
    want = to_titan(build(cfg, device="meta", seed=None).state_dict(), cfg)
    if cfg.tie_word_embeddings:
        want.pop("output.weight")  # one tensor under two names: read it once
    missing = sorted(set(want) - set(meta))
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's torchtitan weights, e.g. "
                         f"{missing[:3]}; is it a checkpoint of this config ({cfg.model_type})?")
    state = {}
    for name, t in want.items():
        if tuple(meta[name].size) != tuple(t.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(meta[name].size)}, the config gives {tuple(t.shape)}")
        state[name] = torch.empty(t.shape, dtype=meta[name].properties.dtype)
    dcp.load(state, storage_reader=reader)
    return from_titan(state, cfg)


def save_dcp(state: dict[str, torch.Tensor], path: str | os.PathLike, cfg: ModelConfig) -> None:
    """Write the workbench's state dict as a model-only torchtitan DCP checkpoint folder (torchtitan's names, as its
    `last_save_model_only` writes), which torchtitan's `CheckpointManager` loads."""
    import torch.distributed.checkpoint as dcp

    dcp.save({k: v.detach() for k, v in to_titan(state, cfg).items()}, checkpoint_id=os.fspath(path))

"""The Qwen3 model on the kernel library, and its checkpoints."""

from .checkpoint import (
    CheckpointError,
    hf_to_titan,
    load_pretrained,
    load_tokenizer,
    merge_gate_up,
    save_pretrained,
    split_gate_up,
    titan_to_hf,
    weights_checksum,
)
from .qwen3 import SIZES, KVCache, Qwen3Config, Qwen3ForCausalLM, build, config, copy_weights

__all__ = [
    "SIZES",
    "CheckpointError",
    "KVCache",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "build",
    "config",
    "copy_weights",
    "hf_to_titan",
    "load_pretrained",
    "load_tokenizer",
    "merge_gate_up",
    "save_pretrained",
    "split_gate_up",
    "titan_to_hf",
    "weights_checksum",
]

"""The one model (Llama, Mistral, Qwen2 and Qwen3 families) on the kernel library, and its checkpoints."""

from .checkpoint import (
    CheckpointError,
    checkpoint_dtype,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    merge_gate_up,
    read_config,
    save_pretrained,
    split_gate_up,
    weights_checksum,
    weights_equal,
)
from .config import FAMILIES, RECOMPUTE, SIZES, ModelConfig, RopeScaling, config
from .hub import FetchError, cache_dir, fetch_model, resolve_model
from .lora import LoraConfig
from .tokenizer import encode_prompt, has_chat_template, load_tokenizer
from .transformer import CausalLM, KVCache, build, check_weights, copy_weights

__all__ = [
    "FAMILIES",
    "FetchError",
    "RECOMPUTE",
    "SIZES",
    "CausalLM",
    "CheckpointError",
    "KVCache",
    "LoraConfig",
    "ModelConfig",
    "RopeScaling",
    "build",
    "cache_dir",
    "check_weights",
    "checkpoint_dtype",
    "config",
    "config_from_hf",
    "config_to_hf",
    "copy_weights",
    "encode_prompt",
    "fetch_model",
    "has_chat_template",
    "load_pretrained",
    "load_tokenizer",
    "merge_gate_up",
    "read_config",
    "resolve_model",
    "save_pretrained",
    "split_gate_up",
    "weights_checksum",
    "weights_equal",
]

"""The workbench's own model run by vLLM, so vLLM's rollouts carry the trainer's log-probs bit for bit.

Issue 7's design (b): vLLM schedules the requests, pages the KV cache and draws the random numbers; every number of
the model comes from the workbench kernels. vLLM's `Attention` layers are held only so that vLLM allocates the paged
cache and builds its metadata; `forward` runs `DecodingModel.hidden_states_paged` on them. `compute_logits` returns,
in place of logits, the trainer's log-prob rows (`logprob_rows`) at the sampling temperature; with
`logprobs_mode='raw_logits'` and temperature 1, vLLM reports them untouched and samples from softmax(log p) = p.
vLLM is imported only when the engine builds or runs the model. In full: docs/generation.md,
"`workbench/generation/vllm_model.py`: the workbench's model inside vLLM".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..kernels import current_state, linear, logprob_rows, mode
from ..models import CausalLM
from ..models.checkpoint import config_from_hf
from ..models.decoding import DecodingModel
from ..models.transformer import PagedKVCache

ARCHITECTURE = "WorkbenchCausalLM"
"""The name vLLM knows this model by (`hf_overrides={'architectures': [ARCHITECTURE]}`)."""


def register() -> None:
    """Make ARCHITECTURE known to vLLM's model registry in this process (the engine must run in it)."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, WorkbenchCausalLM)


def kv_pages(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention cache of one layer -> (k, v) views [pages, page_size, Hkv, D]."""
    if kv_cache.dim() == 4 and kv_cache.shape[-1] == 2 * head_dim:
        # vLLM 0.2x: logical (pages, Hkv, page_size, 2D), K and V side by side in the last dim.
        k, v = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
        return k, v
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        # Older releases: (2, pages, page_size, Hkv, D).
        return kv_cache[0], kv_cache[1]
    raise RuntimeError(f"unknown vLLM KV-cache layout {tuple(kv_cache.shape)} (head_dim {head_dim}); the "
                       "workbench model reads FlashAttention's layouts: run vLLM with the FLASH_ATTN backend")


class _NoCache:
    """vLLM's memory-profiling run has no attention metadata: every op runs, attention gives zeros."""

    def attend(self, layer, q, k, v, start, seq_lens):
        return torch.zeros_like(q)


class WorkbenchCausalLM(CausalLM):
    """`CausalLM` with vLLM's model interface. Parameter names are Hugging Face's, unfused."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        hf = vllm_config.model_config.hf_config
        cfg = config_from_hf(hf.to_dict(), "vLLM's model config")
        super().__init__(cfg)
        # The kernel mode in force when the engine was built; vLLM may call us from anywhere.
        self.kernel_state = current_state()
        self.sampling_temperature = 1.0
        """Temperature of the log-prob rows `compute_logits` returns (VLLMGenerator sets it per call)."""
        from vllm.model_executor.layers.attention import Attention as VLLMAttention

        self.layer_names = []
        for i, layer in enumerate(self.model.layers):
            name = f"model.layers.{i}.self_attn.attn"
            layer.self_attn.attn = VLLMAttention(cfg.num_attention_heads, cfg.head_dim, cfg.head_dim**-0.5,
                                                 num_kv_heads=cfg.num_key_value_heads,
                                                 cache_config=vllm_config.cache_config, prefix=name)
            self.layer_names.append(name)
        # q/k/v and gate/up as one product each, as in the embedded generator (`models/packing.py`): vLLM builds
        # the model in its dtype on its device, then `load_weights` copies into the packed views, in place, which
        # the view built here reads.
        self.pack()
        with self._mode():
            self.decoding = DecodingModel(self)

    def _cache(self) -> PagedKVCache | _NoCache:
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if isinstance(meta, list):
            meta = meta[0]
        if isinstance(meta, dict):
            meta = meta.get(self.layer_names[0])
        if meta is None:
            return _NoCache()
        slots = ctx.slot_mapping
        if isinstance(slots, list):
            slots = slots[0]
        slots = slots.get(self.layer_names[0]) if isinstance(slots, dict) else None
        if slots is None:
            slots = meta.slot_mapping
        n = meta.seq_lens.shape[0]
        pages = [kv_pages(layer.self_attn.attn.kv_cache, self.config.head_dim) for layer in self.model.layers]
        return PagedKVCache(pages, meta.query_start_loc[: n + 1], meta.seq_lens, meta.block_table[:n], slots,
                            int(meta.max_query_len))

    def _mode(self):
        return mode(self.kernel_state.default, **self.kernel_state.overrides)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **_) -> torch.Tensor:
        if inputs_embeds is not None:
            raise NotImplementedError("the workbench model in vLLM takes token ids, not embeddings")
        with self._mode():
            return self.decoding.hidden_states_paged(input_ids, positions, self._cache())  # [N, H]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 log-prob rows [n, V] at `sampling_temperature` (see the module docstring)."""
        with self._mode():
            logits = linear(hidden_states, self.lm_head_weight)                         # [n, V]
            return logprob_rows(logits, self.sampling_temperature)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors into the parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise KeyError(f"workbench model in vLLM: the checkpoint has {name!r}, which the workbench model "
                               "of this config does not; is it a checkpoint of this family and size?")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: the model has shape {tuple(params[name].shape)}, the weights "
                                 f"{tuple(tensor.shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        return loaded

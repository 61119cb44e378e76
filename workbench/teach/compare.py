"""Generator vs trainer on one prompt, token by token (the seed system's "run_comparison").

Generate N tokens with a backend (the embedded generator, or vLLM running the workbench model or
its own), then recompute their log-probs with the trainer's forward in the chosen kernel mode, and
report per token the id, both log-probs in decimal and as fp32 bits in hex, the difference, a mark,
and the bitwise summary. Both sides score the model's own distribution (temperature 1), except
at another temperature with a backend that reports the tempered log-probs (the embedded
generator, vLLM running the workbench model): then both score the distribution sampled from.

On a CPU the bf16 standard kernels can agree token for token (what differs on a GPU is cuBLAS and FlashAttention);
the controls the notebooks use show the mismatch there: `sampler_kernels='engine'` (the `off` arm's generator, an
inference engine's fused norms, SiLU and RoPE) and `dtype='float32'` (notebook 03's `standard fp32`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from ..env import resolve_device
from ..files import make_folder
from ..generation import SamplingParams, generate, parity_summary, parity_table, trainer_logprobs
from ..kernels import FUSED_ROWWISE, mode
from ..models import build, encode_prompt, load_pretrained, load_tokenizer, resolve_model, save_pretrained


PROMPT = "The capital of France is"


@dataclass(frozen=True)
class CompareConfig:
    checkpoint: str = ""
    """A model: a registry name (smollm2-135m-instruct), a checkpoint folder or a hub id; empty: a tiny random model."""
    prompt: str = PROMPT
    """Prompt text (needs the checkpoint's tokenizer: refused with the random checkpoint, which has none); ignored
    when prompt_ids is given."""
    chat_template: bool = True
    """Wrap the prompt text in the tokenizer's chat template (instruct models), where it has one."""
    prompt_ids: tuple[int, ...] = ()
    """Prompt as token ids (for checkpoints without a tokenizer; the random checkpoint uses 8 random ids)."""
    tokens: int = 16
    """New tokens to generate."""
    backend: str = "embedded"
    """'embedded' (the workbench generator) or 'vllm'."""
    kernel_mode: str = "invariant"
    """The trainer's (and the embedded generator's) kernel mode."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    seed: int = 0
    """Sampling seed."""
    model_impl: str = "workbench"
    """vllm backend: 'workbench' (vLLM runs the workbench model and kernels) or 'vllm' (vLLM's own implementation)."""
    batch_invariant: bool = True
    """vllm backend: run vLLM with VLLM_BATCH_INVARIANT=1."""
    gpu_memory_utilization: float = 0.3
    """vllm backend: the share of GPU memory vLLM may take."""
    dtype: str = "bfloat16"
    """The model's weights and activations: 'bfloat16', or 'float32' (embedded backend), notebook 03's CPU control
    (`standard fp32`): a CPU's BLAS may sum the decode step's few rows in another order than the trainer's batch."""
    sampler_kernels: str = "trainer"
    """The embedded generator's kernels: 'trainer' (the trainer's kernel mode) or 'engine' (with kernel_mode
    'standard': an inference engine's, norms, SiLU and RoPE fused and rounded once, the `off` arm's generator)."""
    out_dir: str = "runs/compare"
    """Where the random checkpoint (if any) and the table go."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (the vllm backend needs 'cuda')."""

    def __post_init__(self):
        if self.backend not in ("embedded", "vllm"):
            raise ValueError(f"backend must be 'embedded' or 'vllm', got {self.backend!r}")
        if self.kernel_mode not in ("invariant", "standard"):
            raise ValueError(f"kernel_mode must be 'invariant' or 'standard', got {self.kernel_mode!r}")
        if self.model_impl not in ("workbench", "vllm"):
            raise ValueError(f"model_impl must be 'workbench' or 'vllm', got {self.model_impl!r}")
        if self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
        if self.sampler_kernels not in ("trainer", "engine"):
            raise ValueError(f"sampler_kernels must be 'trainer' or 'engine', got {self.sampler_kernels!r}")
        if self.sampler_kernels == "engine" and (self.kernel_mode != "standard" or self.backend != "embedded"):
            raise ValueError("sampler_kernels='engine' models an inference engine beside a standard trainer: it needs "
                             "kernel_mode='standard' and backend='embedded'")
        if self.dtype == "float32" and self.backend != "embedded":
            raise ValueError("dtype='float32' is the embedded generator's CPU control: use backend='embedded'")
        if not self.checkpoint and not self.prompt_ids and self.prompt != PROMPT:
            raise ValueError("the default random checkpoint has no tokenizer to read --prompt with: give a "
                             "--checkpoint that has one (e.g. smollm2-135m-instruct), or the prompt as --prompt-ids")


def describe(cfg: CompareConfig) -> str:
    """What is compared with what, for the report's head line."""
    engine = " (an engine's kernels)" if cfg.sampler_kernels == "engine" else ""
    fp32 = ", fp32" if cfg.dtype == "float32" else ""
    return f"{cfg.backend} generator{engine} vs trainer ({cfg.kernel_mode} kernels{fp32})"


def _say(message: str) -> None:
    """Progress on stderr: generation and the trainer's pass are each seconds to minutes of silence otherwise."""
    print(f"compare: {message}", file=sys.stderr, flush=True)


def _checkpoint(cfg: CompareConfig, device: str) -> Path:
    if cfg.checkpoint:
        return resolve_model(cfg.checkpoint)
    path = Path(cfg.out_dir) / "checkpoint"
    save_pretrained(build("tiny", device="cpu", dtype=torch.bfloat16, seed=cfg.seed), path)
    return path


def _prompt(cfg: CompareConfig, path: Path, vocab: int) -> list[int]:
    if cfg.prompt_ids:
        ids = [int(t) for t in cfg.prompt_ids]
    elif not cfg.checkpoint:
        ids = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    else:
        no_tokenizer = ValueError(f"{path} has no tokenizer; pass the prompt as token ids (prompt_ids)")
        try:
            tok = load_tokenizer(path)
        except Exception:  # no tokenizer files: say what to pass instead
            raise no_tokenizer from None
        ids = encode_prompt(tok, cfg.prompt, cfg.chat_template)
        if not ids:
            raise no_tokenizer
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        raise ValueError(f"prompt ids must be a non-empty list in [0, {vocab}), got {ids[:8]}...")
    return ids


def compare(cfg: CompareConfig) -> pd.DataFrame:
    """The per-token parity table (see `workbench.generation.parity_table`) of backend vs trainer."""
    if cfg.backend == "vllm":
        from ..generation.vllm_backend import require_vllm

        require_vllm()  # before anything else: say what is missing
    device = resolve_device("cuda" if cfg.backend == "vllm" else cfg.device)
    folder = make_folder(cfg.out_dir)
    path = _checkpoint(cfg, device)
    model = load_pretrained(path, dtype=getattr(torch, cfg.dtype), device=device)
    prompt = _prompt(cfg, path, model.config.vocab_size)
    params = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.tokens, seed=cfg.seed)
    slow = device == "cpu" and cfg.kernel_mode == "invariant" and cfg.checkpoint
    _say(f"generating {cfg.tokens} tokens with the {cfg.backend} generator ({cfg.kernel_mode} kernels, {device})"
         + (": Triton's interpreter runs a real model's invariant kernels slowly on a CPU (minutes; "
            "--kernel-mode standard takes seconds)" if slow else "") + " ...")
    if cfg.backend == "vllm":
        from ..generation.vllm_backend import VLLMGenerator

        engine = VLLMGenerator(path, gpu_memory_utilization=cfg.gpu_memory_utilization,
                               batch_invariant=cfg.batch_invariant, seed=cfg.seed, model_impl=cfg.model_impl,
                               kernel_mode=cfg.kernel_mode)
        out = engine.generate([prompt], params)
    else:
        with mode(cfg.kernel_mode, **(FUSED_ROWWISE if cfg.sampler_kernels == "engine" else {})):
            out = generate(model, [prompt], params)
    tokens = [c.tokens for c in out.completions]
    tempered = cfg.temperature not in (0, 1) and (cfg.backend == "embedded" or cfg.model_impl == "workbench")
    _say("recomputing their log-probs with the trainer's forward ...")
    with mode(cfg.kernel_mode):
        recomputed = trainer_logprobs(model, [prompt], tokens, params if tempered else None)
    table = parity_table([c.sampled_logprobs if tempered else c.logprobs for c in out.completions], recomputed,
                         tokens)
    table.to_csv(folder / "comparison.csv", index=False)
    control = cfg.dtype == "float32" or cfg.sampler_kernels == "engine"
    if device == "cpu" and cfg.kernel_mode == "standard" and not control and parity_summary(table)["bitwise_identical"]:
        _say("on a CPU the bf16 standard kernels can agree token for token (cuBLAS and FlashAttention are what "
             "differ on a GPU); --sampler-kernels engine (the `off` arm's generator) or --dtype float32 (notebook "
             "03's control) shows the mismatch here")
    return table

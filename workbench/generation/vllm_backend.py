"""vLLM as an optional rollout backend, with the embedded generator's interface.

`VLLMGenerator(checkpoint)` runs vLLM's offline `LLM` in this process, on this GPU, beside the trainer. With
`model_impl='workbench'` (the default) vLLM runs the workbench's own model and kernels (`vllm_model.py`), so in
`invariant` mode its log-probs are the trainer's, bit for bit, at any batch, chunking or paging; `model_impl='vllm'`
(vLLM's own model and kernels) is the control. `generate` returns the embedded generator's `GenerationOutput`, with
per-request seeds (vLLM's random numbers are not the embedded generator's). Weights sync without a restart
(`load_weights`, `load_checkpoint`), each sync verified bit for bit by checksums. The workbench imports and works
without vLLM; only constructing a `VLLMGenerator` needs it. In full: docs/generation.md,
"`workbench/generation/vllm_backend.py`: vLLM as a rollout backend".
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

import torch

from ..kernels import mode
from ..kernels.attention import KV_TILE
from ..models import weights_checksum
from .generator import Completion, GenerationOutput
from .sampling import SamplingParams

# Releases and the torch their wheels pin (vLLM installs that torch).
VLLM_TORCH = {"0.26.0": "2.11.0", "0.27": "2.13.0", "0.28": "2.13.0", "0.29": "2.13.0"}

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class BackendUnavailable(RuntimeError):
    """A generator backend was asked for but cannot run here."""


def require_vllm() -> None:
    """Raise BackendUnavailable, saying what to install, unless vLLM and a GPU are here.

    Looks vLLM up without importing it: its settings (VLLM_BATCH_INVARIANT, ...) must be in the
    environment before the first import, which `VLLMGenerator` does.
    """
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise BackendUnavailable(
            "the vllm backend needs vLLM, which is not installed here. Install the release that matches "
            f"your torch ({torch.__version__}): vLLM 0.26.0 pins torch 2.11.0, 0.27-0.29 pin torch 2.13.0 "
            "(pip install 'vllm==0.26.0'); on a GPU host without network, ../shared/tools/pack_vllm.sh packs it. "
            "The embedded generator (backend='embedded') needs nothing more."
        )
    if not torch.cuda.is_available():
        raise BackendUnavailable("the vllm backend runs on a CUDA GPU; this machine has none")


def to_vllm_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> vLLM's: q/k/v fused into qkv_proj, gate/up into gate_up_proj (rows
    stacked in that order; Qwen2's q/k/v biases likewise), every other tensor under its own name."""
    out: dict[str, torch.Tensor] = {}
    used = set()
    for name in sorted(state):
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                if name.endswith(f".{parts[0]}.{kind}"):
                    prefix = name[: -len(f"{parts[0]}.{kind}")]
                    names = [f"{prefix}{p}.{kind}" for p in parts]
                    missing = [n for n in names if n not in state]
                    if missing:
                        raise KeyError(f"to_vllm_layout: {missing} missing beside {name}")
                    out[f"{prefix}{fused}.{kind}"] = torch.cat([state[n] for n in names], dim=0)
                    used.update(names)
    for name, t in state.items():
        if name not in used:
            out[name] = t
    return out


def from_vllm_layout(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The inverse of `to_vllm_layout`, given each unfused tensor's shape (e.g. from the trainer's model)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        fused = next(((f, kind) for f in _FUSED for kind in ("weight", "bias") if name.endswith(f".{f}.{kind}")), None)
        if fused is None:
            out[name] = t
            continue
        (f, kind) = fused
        prefix = name[: -len(f"{f}.{kind}")]
        names = [f"{prefix}{p}.{kind}" for p in _FUSED[f]]
        for part, n in zip(torch.split(t, [shapes[n][0] for n in names], dim=0), names):
            out[n] = part
    return out


def request_seed(seed: int, request_id: int) -> int:
    """A request's own seed: the same request samples the same tokens in any batch."""
    return (seed * 1_000_003 + request_id) % (2**31 - 1)


MODEL_IMPLS = ("workbench", "vllm")
START_LOCK = Path(tempfile.gettempdir(), f"workbench-vllm-start-{os.getuid()}.lock")
"""Held while an engine starts: the lock file that lets one vLLM engine on this host profile memory at a time
(per user: another user's file in a shared /tmp could not be opened, so their starts do not wait for ours)."""


@contextlib.contextmanager
def one_start_at_a_time(path: Path = START_LOCK):
    """Serialize engine starts across the processes of this host.

    vLLM sizes its KV cache from how much device memory grew while it profiled. Another process that allocates
    meanwhile (a second engine starting on the same GPU) counts as this engine's own use, and the KV cache comes
    out short or negative ("No available memory for the cache blocks"): it happened to one of two ON/OFF runs
    started together on an H100. The lock is per host, not per GPU, because CUDA_VISIBLE_DEVICES renumbers
    devices per process; a start takes seconds, so waiting for another GPU's costs little.
    """
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class VLLMGenerator:
    """vLLM's offline engine over a Hugging Face checkpoint (Llama, Mistral, Qwen2 or Qwen3), in this process.

    max_model_len None takes the checkpoint's max_position_embeddings (40960 for Qwen3, 8192 for SmolLM2): pass a
    smaller one to fit a small memory share. model_impl 'workbench' runs its decode steps as full CUDA graphs
    (one per batch size vLLM captures), its prefills eagerly, and everything eagerly with enforce_eager or in
    kernel_mode 'standard'. vLLM's batch-invariant mode, once on, also replaces `aten::mm`,
    `log_softmax` and `mean` for the rest of the process (the workbench's invariant kernels do not
    use them).
    """

    def __init__(self, checkpoint: str | Path, gpu_memory_utilization: float = 0.3, batch_invariant: bool = True,
                 max_model_len: int | None = None, enforce_eager: bool = False, seed: int = 0,
                 model_impl: str = "workbench", kernel_mode: str = "invariant"):
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {model_impl!r}")
        if not Path(checkpoint, "config.json").exists():
            raise FileNotFoundError(f"vllm backend: no Hugging Face checkpoint (config.json) in {checkpoint}")
        if not 0 < gpu_memory_utilization < 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1), got {gpu_memory_utilization}")
        # Both must be set before vLLM is imported: the mode is read at import, and the engine must
        # run in this process for load_weights to reach the model.
        os.environ["VLLM_BATCH_INVARIANT"] = "1" if batch_invariant else "0"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        require_vllm()
        import vllm

        self.batch_invariant = batch_invariant
        self.model_impl = model_impl
        self.seed = seed
        # Prompts come as token ids; a checkpoint without tokenizer files needs none.
        self.has_tokenizer = any(Path(checkpoint, f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        # max_model_len None: the checkpoint's max_position_embeddings.
        options = dict(model=str(checkpoint), dtype="bfloat16", gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                       enable_prefix_caching=False, skip_tokenizer_init=not self.has_tokenizer)
        if model_impl == "workbench":
            from . import vllm_model

            vllm_model.register()
            # No torch.compile: our kernels are Triton launches that Dynamo would only trace around. Decode steps
            # (one token per request) are captured whole (FULL_DECODE_ONLY): the step's metadata lives in vLLM's
            # persistent buffers, padded requests have no query rows and skip their KV write (slot -1), and no
            # invariant kernel reads a tensor on the host. Standard paged attention gathers each sequence's keys
            # by a host-side length (`_paged_sdpa`), which a graph cannot hold: it stays eager.
            # FlashAttention's metadata and cache layout are the ones `vllm_model` reads.
            eager = enforce_eager or kernel_mode == "standard"
            # Pages of one K/V tile (vLLM's default is 16 keys): each tile of the decode attention then reads one
            # block-table entry and contiguous keys, as the static cache's does: a faster decode step with the same
            # bits (the paging never moves a bit; BENCHMARKS.md, "Numbers behind the code").
            options.update(hf_overrides={"architectures": [vllm_model.ARCHITECTURE]}, logprobs_mode="raw_logits",
                           enforce_eager=eager, attention_config={"backend": "FLASH_ATTN"}, block_size=KV_TILE)
            if not eager:
                options["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        with mode(kernel_mode), one_start_at_a_time():  # the workbench model keeps the mode it is built in
            self.llm = vllm.LLM(**options)
        self._vllm = vllm

    def model(self) -> torch.nn.Module:
        """The running engine's torch model (in-process engine only)."""
        engine = self.llm.llm_engine
        for path in ("model_executor.driver_worker.worker.model_runner.model",
                     "engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model"):
            obj = engine
            try:
                for attr in path.split("."):
                    obj = getattr(obj, attr)
                return obj
            except AttributeError:
                continue
        raise BackendUnavailable(f"cannot reach the model inside vLLM {self._vllm.__version__}'s engine; "
                                 "run with VLLM_ENABLE_V1_MULTIPROCESSING=0")

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 request_ids: list[int] | None = None) -> GenerationOutput:
        """Sample a completion per prompt. Log-probs, by model_impl:

        - workbench: `sampled_logprobs` are the trainer's log-probs of the distribution sampled from
          (softmax(logits / T)); `logprobs` (temperature 1) equal them at T = 1 and are NaN at other
          temperatures. No top-k / top-p (vLLM's truncation is not ours).
        - vllm: `logprobs` are vLLM's raw log-probs (temperature 1); `sampled_logprobs` equal them at
          T = 1 without truncation, and are NaN otherwise.
        - Greedy decoding (T = 0), either way: `logprobs` at temperature 1, `sampled_logprobs` 0.
        """
        ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        temperature, ours = params.temperature, self.model_impl == "workbench"
        if ours:
            if params.top_k or params.top_p < 1:
                raise ValueError("the workbench model in vLLM samples without top-k / top-p (vLLM would truncate "
                                 "with its own arithmetic); use the embedded generator for truncated sampling")
            # The model's rows are tempered log-probs already: vLLM samples them at temperature 1.
            self.model().sampling_temperature = temperature if temperature > 0 else 1.0
            temperature = 1.0 if temperature > 0 else 0.0
        sp = [self._vllm.SamplingParams(
            temperature=temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids), logprobs=0,
            seed=request_seed(params.seed, r), ignore_eos=not params.stop_token_ids, detokenize=self.has_tokenizer,
        ) for r in ids]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        completions = []
        for r, prompt, out in zip(ids, prompts, outs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            lp = torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(tokens)], dtype=torch.float32)
            nan = torch.full_like(lp, float("nan"))
            if params.greedy:
                raw, sampled = lp, torch.zeros_like(lp)
            elif ours:
                raw, sampled = (lp.clone() if params.temperature == 1 else nan), lp
            else:
                untouched = params.temperature == 1 and params.top_k == 0 and params.top_p == 1
                raw, sampled = lp, (lp.clone() if untouched else nan)
            completions.append(Completion(request_id=r, prompt=list(prompt), tokens=tokens, logprobs=raw,
                                          sampled_logprobs=sampled,
                                          finish_reason="stop" if c.finish_reason == "stop" else "length"))
        return GenerationOutput(completions, prefill_s=0.0, decode_s=seconds, steps=params.max_new_tokens)

    def weights_checksum(self) -> str:
        """sha256 of the engine model's parameters (its layout; tied weights once)."""
        return weights_checksum(dict(self.model().named_parameters()))

    def expected_checksum(self, state: dict[str, torch.Tensor]) -> str:
        """The checksum the engine shows once it holds `state` (HF names): fused for vLLM's own model."""
        layout = to_vllm_layout(state) if self.model_impl == "vllm" else dict(state)
        if "lm_head.weight" not in dict(self.model().named_parameters()):
            layout.pop("lm_head.weight", None)  # tied to the embedding
        return weights_checksum(layout)

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> float:
        """In-place sync of the trainer's bf16 tensors (HF names) into the running engine; returns seconds."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.model().load_weights(iter(state.items()))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def load_checkpoint(self, path: str | Path) -> float:
        """Sync through disk: read a safetensors checkpoint and load it in place; returns seconds."""
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"vllm backend: no *.safetensors in {path}")
        for f in files:
            self.load_weights(load_file(f, device="cuda"))
        return time.perf_counter() - t0

"""The embedded generator: batched sampling on a static KV cache, with per-token log-probs.

One prefill over the right-padded prompts, then one decode step per new token,
every request at its own position. Each step (recording the pending tokens, the
model, sampling the next) is one CUDA graph on a GPU, with no data-dependent
Python branch. Finished requests leave the batch: when at most half the rows are
still running, the cache is compacted to those rows (in `invariant` mode a row's
bits do not depend on the batch, so this changes no result).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

from ..kernels import current_state, get_mode, linear, pdl
from ..kernels.runtime import interpreting
from ..models import KVCache, CausalLM
from ..kernels.record import record_add, record_add_reference
from ..models.decoding import DecodingModel
from .sampling import KEYED_SEED, SamplingParams, request_keys, sample


@dataclass
class Completion:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    """Generated token ids (the stop token included when one ended the request)."""
    logprobs: torch.Tensor
    """fp32 [len(tokens)]: log p(token) under the model's own distribution (temperature 1)."""
    sampled_logprobs: torch.Tensor
    """fp32 [len(tokens)]: log p(token) under the tempered, truncated distribution sampled from."""
    finish_reason: str
    """'stop' (a stop token) or 'length' (max_new_tokens)."""


@dataclass
class GenerationOutput:
    completions: list[Completion]
    prefill_s: float
    decode_s: float
    steps: int

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.new_tokens / total if total > 0 else float("nan")


def _check_prompts(prompts, vocab: int) -> None:
    if not prompts:
        raise ValueError("generate: no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab})")


def _next_logits(model: DecodingModel, hidden: torch.Tensor) -> torch.Tensor:
    return linear(hidden, model.lm_head_weight)                                  # [B, V]


# The host reads the live-row count (a GPU sync) every this many steps, not every step: between reads it only
# queues graph replays, so the GPU runs them back to back. A batch that has finished runs at most this many - 1
# steps more (their tokens are not recorded), and compaction comes up to as many steps later; in invariant mode
# neither changes a bit.
CHECK_EVERY = 4


@dataclass
class Record:
    """Every request's tokens and log-probs so far; `DecodeStep` writes into it, rows mapped to requests."""

    tokens: torch.Tensor    # [B, N] long
    raw: torch.Tensor       # [B, N] fp32
    sampled: torch.Tensor   # [B, N] fp32
    n_out: torch.Tensor     # [B] long: tokens recorded per request
    done: torch.Tensor      # [B] bool: ended by a stop token

    @classmethod
    def allocate(cls, b: int, n: int, device) -> Record:
        raw = torch.zeros((b, n), device=device, dtype=torch.float32)
        return cls(torch.zeros((b, n), device=device, dtype=torch.long), raw, torch.zeros_like(raw),
                   torch.zeros(b, device=device, dtype=torch.long), torch.zeros(b, device=device, dtype=torch.bool))

    def zero_(self) -> None:
        for t in (self.tokens, self.raw, self.sampled, self.n_out, self.done):
            t.zero_()

    def add(self, rows, column, tok, lp, slp, stop) -> None:
        """Record each live row's token at `column` (a device scalar); rows already done ride along unrecorded.
        One launch, no host read: it runs inside the decode step's graph (`record_add`)."""
        add = record_add if self.tokens.is_cuda or interpreting() else record_add_reference
        add(self.tokens, self.raw, self.sampled, self.n_out, self.done, rows, column, tok, lp, slp, stop)


class DecodeStep:
    """The decode loop's body for a fixed number of rows: record each row's pending token, then run the model on
    it and sample the next, which becomes pending. Its state (rows, pending token, positions, the step's column)
    lives in static buffers it advances itself, so on a GPU the whole body is one CUDA graph replayed with no
    host work in between; `load` refills those buffers, so a later call of the same shape replays the same graph.
    """

    def __init__(self, model: DecodingModel, cache: KVCache, params: SamplingParams, record: Record, stop,
                 graph: bool):
        """params: with seed KEYED_SEED; each row's seed is in its key (`request_keys`), loaded as its request id."""
        self.model, self.cache, self.params, self.record, self.stop = model, cache, params, record, stop
        b, dev = cache.k.shape[1], stop.device
        self.rows, self.req, self.tok = (torch.zeros(b, device=dev, dtype=torch.long) for _ in range(3))
        self.pos = torch.zeros(b, device=dev, dtype=torch.int32)
        self.lp, self.slp = torch.zeros(b, device=dev), torch.zeros(b, device=dev)
        self.column = torch.zeros((), device=dev, dtype=torch.long)     # the pending token's index
        self.ones = torch.ones_like(self.pos)
        self.use_graph = graph
        self.graph = None

    def load(self, rows, req, pending: tuple, pos, column) -> DecodeStep:
        """Start from these rows (indices into the record), their keys (`request_keys`), pending (token, log-prob,
        sampled log-prob), positions and the pending token's index."""
        for buf, value in zip((self.rows, self.req, self.tok, self.lp, self.slp, self.pos, self.column),
                              (rows, req, *pending, pos, column)):
            buf.copy_(value)
        return self

    def _body(self) -> None:
        self.record.add(self.rows, self.column, self.tok, self.lp, self.slp, self.stop)
        # Programmatic dependent launch where the step is a chain of our own small kernels (invariant `linear`);
        # between cuBLAS launches it measured slower (`kernels.pdl`). The same bits either way.
        with pdl(get_mode("linear") == "invariant"):
            hidden = self.model.hidden_states(self.tok[:, None], seq_lens=self.ones, cache=self.cache,
                                              start=self.pos)
            # Randomness is keyed by (seed and request id: the row's key, index of the new token): not by batch or
            # prompt length.
            tok, lp, slp = sample(_next_logits(self.model, hidden[:, 0]), self.params, self.req,
                                  (self.column + 1).expand_as(self.req).contiguous())
        self.tok.copy_(tok)
        self.lp.copy_(lp)
        self.slp.copy_(slp)
        self.pos += 1
        self.column += 1

    def __call__(self) -> None:
        if not self.use_graph:
            return self._body()
        if self.graph is None:
            # Captured at the first call and replayed, the first time included: the body advances its own state,
            # so it must run exactly once per call. No eager warm-up run: Triton compiles and cuBLAS/FlashAttention
            # set up inside the capture (nothing in the body syncs with the host), which saves a whole step's
            # ~140 us of Python per launch at every generate call's first step.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._body()
            self.graph = graph                  # only once whole: a failed capture is not replayed by a later call
        self.graph.replay()
        return None

    def finish(self) -> None:
        """Record the pending tokens (the last step's, or those of rows the loop stopped)."""
        self.record.add(self.rows, self.column, self.tok, self.lp, self.slp, self.stop)

    def compact_into(self, keep: torch.Tensor, step: DecodeStep) -> DecodeStep:
        """Load `step` (whose cache has len(keep) rows) with the rows `keep` (indices into this step's rows)."""
        torch.index_select(self.cache.k, 1, keep, out=step.cache.k)
        torch.index_select(self.cache.v, 1, keep, out=step.cache.v)
        return step.load(self.rows[keep], self.req[keep], (self.tok[keep], self.lp[keep], self.slp[keep]),
                         self.pos[keep], self.column)


def compacted_size(n_live: int, size: int) -> int:
    """The rows a batch of `size` rows with `n_live` running keeps: halved (rounded up) while the live rows fit
    in half, so a batch of b rows only ever takes the sizes b, ceil(b/2), ... (a bounded set of cache shapes and
    graphs to keep) and is never more than twice its live rows after a compaction."""
    while n_live * 2 <= size and size > 1:
        size = (size + 1) // 2
    return size


# A kept cache's length is rounded up to this many positions, so calls whose longest prompt differs a little (an RL
# loop's batches) share one shape. Keys past a row's length are never read, so in invariant mode no bit depends on it.
CACHE_ROUND = 64


class DecodeGraphs:
    """One `generate` call's model view (`DecodingModel`), KV caches, record and captured decode steps, kept for
    the next call of the same shape.

    Without it every call allocates its cache and captures its decode step (one per compaction size) anew; the
    capture walks every launch of the step on the host, tens of milliseconds a graph at the 1.7B shape. vLLM
    captures once, at start-up; passed to `generate`, this does the same for the embedded generator. A call whose
    batch size, cache length (rounded up to CACHE_ROUND), sampling parameters, model tensors and kernel modes are
    the previous call's replays that call's graphs on that call's view; any other call builds them anew (a weight
    replaced rather than updated in place, say by a checkpoint sync, is a new view). The memory (the caches of every
    compaction size, the graphs' pools) stays held between calls: `clear()` returns it, e.g. before an update.
    """

    def __init__(self):
        self._key = None
        self._steps: dict[int, DecodeStep] = {}
        self.decoding: DecodingModel | None = None

    def clear(self) -> None:
        self._key, self._steps, self.decoding = None, {}, None

    def begin(self, model: CausalLM, params: SamplingParams, b: int, max_len: int, graph: bool) -> None:
        """Start a call: keep everything if it has the last call's shape (`_graph_key`), else start empty."""
        key = _graph_key(model, params, b, max_len, graph)
        if key == self._key:
            # As a fresh call finds them: the prefill's tiles then read zeros past each prompt, not old keys.
            self.record.zero_()
            if b in self._steps:
                self._steps[b].cache.k.zero_()
                self._steps[b].cache.v.zero_()
            return
        self.clear()
        self._key = key
        dev = model.lm_head_weight.device
        self.decoding = DecodingModel(model)      # under the call's kernel modes, part of the key
        self.max_len, self.dtype, self.graph = max_len, model.lm_head_weight.dtype, graph
        self.params = replace(params, seed=KEYED_SEED)
        self.record = Record.allocate(b, params.max_new_tokens, dev)
        self.stop = torch.tensor(params.stop_token_ids or [-1], device=dev)

    def step(self, rows: int) -> DecodeStep:
        """The decode step over `rows` rows and its cache; a kept one's graph replays as captured."""
        if rows not in self._steps:
            cache = KVCache.allocate(self.decoding.config, rows, self.max_len, self.stop.device, self.dtype)
            self._steps[rows] = DecodeStep(self.decoding, cache, self.params, self.record, self.stop, self.graph)
        return self._steps[rows]


def _graph_key(model: CausalLM, params: SamplingParams, b: int, max_len: int, graph: bool) -> tuple:
    """What a captured step and the view it runs bake in: the model's tensors (by address: an in-place weight update
    is read by the replay, a replaced tensor is not; their packing), its LoRA scales, the sampling parameters but
    the seed (Python constants of the sampler; the seed is in the rows' keys), the kernel modes and PDL switch
    (which kernels were launched), and the shapes."""
    state = current_state()
    return (id(model), tuple((t.data_ptr(), t.shape, t.dtype) for t in (*model.parameters(), *model.buffers())),
            tuple(getattr(m, "lora_scale", None) for m in model.modules()), replace(params, seed=0), b,
            max_len, graph,
            state.default, tuple(sorted(state.overrides.items())), os.environ.get("WORKBENCH_PDL", "1"))


@torch.no_grad()
def generate(model: CausalLM, prompts: list[list[int]], params: SamplingParams,
             request_ids: list[int] | None = None, cuda_graphs: bool = True,
             keep: DecodeGraphs | None = None) -> GenerationOutput:
    """Sample a completion for each prompt; request_ids (default 0..B-1) key each request's randomness.

    On a GPU the decode step runs as a CUDA graph unless cuda_graphs=False (same bits either way). `keep` holds
    the caches and graphs between calls (`DecodeGraphs`); in invariant mode the bits are those of a call without.
    """
    cfg = model.config
    _check_prompts(prompts, cfg.vocab_size)
    b = len(prompts)
    ids_list = list(range(b)) if request_ids is None else list(request_ids)
    if len(ids_list) != b:
        raise ValueError(f"generate: {b} prompts but {len(ids_list)} request ids")
    dev = model.lm_head_weight.device
    lens = torch.tensor([len(p) for p in prompts], device=dev, dtype=torch.int32)
    p_max = int(lens.max())
    if p_max + params.max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"generate: prompt ({p_max}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({cfg.max_position_embeddings})")
    ids = torch.zeros((b, p_max), device=dev, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=dev)
    req = torch.tensor(ids_list, device=dev, dtype=torch.long)
    graphs = cuda_graphs and dev.type == "cuda"
    max_len = p_max + params.max_new_tokens
    if keep is None:
        keep = DecodeGraphs()
    elif not isinstance(keep, DecodeGraphs):
        raise TypeError(f"generate: keep must be a DecodeGraphs (or None), got {type(keep).__name__}")
    else:
        max_len = -(-max_len // CACHE_ROUND) * CACHE_ROUND
    keep.begin(model, params, b, max_len, graphs)
    step_fn = keep.step(b)
    cache = step_fn.cache

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    hidden = keep.decoding.hidden_states(ids, lens, cache, torch.zeros_like(lens))                # [B, P, H]
    last = hidden[torch.arange(b, device=dev), lens.long() - 1]                                  # [B, H]
    # Randomness is keyed by (seed, request id, index of the new token): not by batch or prompt length.
    tok, lp, slp = sample(_next_logits(keep.decoding, last), params, req, torch.zeros_like(req))
    sync()
    t1 = time.perf_counter()

    record = keep.record
    step_fn.load(torch.arange(b, device=dev), request_keys(params.seed, req), (tok, lp, slp), lens, 0)
    step = 0                                                    # index of the pending token
    while step + 1 < params.max_new_tokens:
        if step % CHECK_EVERY == 0:
            live = ~record.done[step_fn.rows]
            n_live = int(live.sum())
            if n_live == 0:
                break
            if n_live * 2 <= live.numel():
                # The live rows, then finished ones (which ride along unrecorded) up to the compacted size.
                size = compacted_size(n_live, live.numel())
                rows = torch.argsort((~live).to(torch.int8), stable=True)[:size].sort().values
                step_fn = step_fn.compact_into(rows, keep.step(size))
        step_fn()
        step += 1
    step_fn.finish()
    steps = step + 1
    sync()
    t2 = time.perf_counter()

    completions = []
    for i in range(b):
        n = int(record.n_out[i])
        completions.append(Completion(
            request_id=ids_list[i], prompt=list(prompts[i]), tokens=record.tokens[i, :n].tolist(),
            logprobs=record.raw[i, :n].cpu(), sampled_logprobs=record.sampled[i, :n].cpu(),
            finish_reason="stop" if bool(record.done[i]) else "length",
        ))
    return GenerationOutput(completions, prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps)

"""The embedded generator: batched sampling on a static KV cache, with per-token log-probs.

One prefill over the right-padded prompts, then one decode step per new token,
every request at its own position. Finished requests leave the batch: when at
most half the rows are still running, the cache is compacted to those rows (in
`invariant` mode a row's bits do not depend on the batch, so this changes no
result). The decode step itself has no data-dependent Python branch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..kernels import linear
from ..models import KVCache, CausalLM
from .sampling import SamplingParams, sample


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


def _next_logits(model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
    return linear(hidden, model.lm_head_weight)                                  # [B, V]


class DecodeStep:
    """One decode step for a fixed set of rows: the model on one token per row, then sampling.

    On a GPU the step is captured once as a CUDA graph and replayed (its inputs
    are copied into static buffers), so a step costs no Python launch overhead.
    """

    def __init__(self, model: CausalLM, cache: KVCache, params: SamplingParams, rows: int, graph: bool):
        dev = model.lm_head_weight.device
        self.model, self.cache, self.params = model, cache, params
        self.tok = torch.zeros(rows, device=dev, dtype=torch.long)
        self.pos = torch.zeros(rows, device=dev, dtype=torch.int32)
        self.req = torch.zeros(rows, device=dev, dtype=torch.long)
        self.index = torch.zeros(rows, device=dev, dtype=torch.long)
        self.ones = torch.ones(rows, device=dev, dtype=torch.int32)
        self.use_graph = graph
        self.graph = None

    def _body(self):
        hidden = self.model.hidden_states(self.tok[:, None], seq_lens=self.ones, cache=self.cache, start=self.pos)
        return sample(_next_logits(self.model, hidden[:, 0]), self.params, self.req, self.index)

    def __call__(self, tok, pos, req, index):
        """(tokens, raw log-probs, sampled log-probs) for the tokens after `tok` at positions `pos`."""
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.req.copy_(req)
        self.index.copy_(index)
        if not self.use_graph:
            return self._body()
        if self.graph is None:
            # Warm up (compilation, allocator, handles) on these very inputs: it writes the same K/V
            # the replay below writes again, so the cache never holds another token's keys.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._body()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._body()
        self.graph.replay()
        return self.out


@torch.no_grad()
def generate(model: CausalLM, prompts: list[list[int]], params: SamplingParams,
             request_ids: list[int] | None = None, cuda_graphs: bool = True) -> GenerationOutput:
    """Sample a completion for each prompt; request_ids (default 0..B-1) key each request's randomness.

    On a GPU the decode step runs as a CUDA graph unless cuda_graphs=False (same bits either way).
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
    stop = torch.tensor(params.stop_token_ids or [-1], device=dev)
    dtype = model.lm_head_weight.dtype
    cache = KVCache.allocate(cfg, b, p_max + params.max_new_tokens, dev, dtype)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    hidden = model.hidden_states(ids, seq_lens=lens, cache=cache, start=torch.zeros_like(lens))  # [B, P, H]
    last = hidden[torch.arange(b, device=dev), lens.long() - 1]                                  # [B, H]
    # Randomness is keyed by (seed, request id, index of the new token): not by batch or prompt length.
    tok, lp, slp = sample(_next_logits(model, last), params, req, torch.zeros_like(req))
    sync()
    t1 = time.perf_counter()

    tokens = torch.zeros((b, params.max_new_tokens), device=dev, dtype=torch.long)
    raw = torch.zeros((b, params.max_new_tokens), device=dev, dtype=torch.float32)
    smp = torch.zeros_like(raw)
    n_out = torch.zeros(b, device=dev, dtype=torch.long)       # tokens generated so far, per request
    done = torch.zeros(b, device=dev, dtype=torch.bool)
    stopped = torch.zeros(b, device=dev, dtype=torch.bool)
    rows = torch.arange(b, device=dev)                          # live rows -> original request index
    pos = lens.clone()                                          # position where each live row's `tok` goes
    graphs = cuda_graphs and dev.type == "cuda"
    step_fn = None
    steps = 0
    for step in range(params.max_new_tokens):
        running = ~done[rows]                                   # finished rows ride along until compaction
        tokens[rows, step] = torch.where(running, tok, tokens[rows, step])
        raw[rows, step] = torch.where(running, lp, raw[rows, step])
        smp[rows, step] = torch.where(running, slp, smp[rows, step])
        n_out[rows] += running.long()
        hit = torch.isin(tok, stop) & running
        stopped[rows] |= hit
        done[rows] |= hit
        steps += 1
        if step + 1 == params.max_new_tokens:
            break
        live = ~done[rows]
        n_live = int(live.sum())
        if n_live == 0:
            break
        if n_live * 2 <= rows.numel():
            keep = live.nonzero().squeeze(1)
            rows, pos, tok = rows[keep], pos[keep], tok[keep]
            cache = KVCache(cache.k[:, keep].contiguous(), cache.v[:, keep].contiguous())
            step_fn = None
        if step_fn is None:
            step_fn = DecodeStep(model, cache, params, rows.numel(), graphs)
        index = torch.full_like(rows, step + 1)
        tok, lp, slp = step_fn(tok, pos, req[rows], index)
        pos = pos + 1
    sync()
    t2 = time.perf_counter()

    completions = []
    for i in range(b):
        n = int(n_out[i])
        completions.append(Completion(
            request_id=ids_list[i], prompt=list(prompts[i]), tokens=tokens[i, :n].tolist(),
            logprobs=raw[i, :n].cpu(), sampled_logprobs=smp[i, :n].cpu(),
            finish_reason="stop" if bool(stopped[i]) else "length",
        ))
    return GenerationOutput(completions, prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps)

"""The kept KV caches lent between rollouts on a GPU (CUDA virtual memory, `generation/lendable.py`): the memory
really goes back to the device, the captured graphs are replayed at the same addresses, and after a borrower filled
the memory with NaNs every token and log-prob is a fresh call's (skipped without CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import same_completions

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.models import build

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(temperature=1.0, top_k=0, top_p=0.95, max_new_tokens=24, seed=5)


def _prompts(n: int, vocab: int, seed: int, lo: int = 8, hi: int = 96):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lens]


def _borrow_everything() -> None:
    """What an update does with the lent memory, at its worst: every free byte but a little written with NaNs."""
    free = torch.cuda.mem_get_info()[0]
    junk = torch.full(((free - 2**30) // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()
    del junk


def test_gpu_lent_caches_free_their_memory_and_replay_the_same_graphs_with_a_fresh_calls_bits():
    model = build("qwen3-1.7B", device="cuda", seed=10)
    prompts = _prompts(64, model.config.vocab_size, seed=11)
    fresh = generate(model, prompts, PARAMS).completions
    keep = DecodeGraphs(lendable=True)
    assert same_completions(generate(model, prompts, PARAMS, keep=keep).completions, fresh)
    step = keep.step(64)
    graph, address = step.graph, step.cache.k.data_ptr()
    cache_bytes = 2 * step.cache.k.numel() * step.cache.k.element_size()
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    keep.lend()
    assert torch.cuda.mem_get_info()[0] - free >= cache_bytes, "lent: the cache's memory is the device's again"
    with pytest.raises(RuntimeError, match="lent"):
        generate(model, prompts, PARAMS, keep=keep)
    _borrow_everything()
    keep.take_back()
    assert same_completions(generate(model, prompts, PARAMS, keep=keep).completions, fresh)
    assert keep.step(64) is step and step.graph is graph and step.cache.k.data_ptr() == address, "replayed"
    # Rows compacted into a kept smaller step (40 of 64 requests stop at their first token), across two lends.
    stops = dataclasses.replace(PARAMS, stop_token_ids=tuple({c.tokens[0] for c in fresh[:40]}))
    stopped = generate(model, prompts, stops).completions
    keep = DecodeGraphs(lendable=True)
    for _ in range(3):
        assert same_completions(generate(model, prompts, stops, keep=keep).completions, stopped)
        keep.lend()
        _borrow_everything()
        keep.take_back()
    assert 32 in keep._steps, "the batch was compacted into a kept step of 32 rows"


def test_gpu_trainer_lending_its_kv_cache_gets_the_held_caches_metrics(tmp_path):
    from workbench.rl.config import TrainConfig
    from workbench.rl.policy import PolicyConfig, train_policy
    from workbench.rl.trainer import train

    train_policy(PolicyConfig(device="cuda"), tmp_path / "policy")   # both runs start from its saved bf16 weights
    base = dict(policy=str(tmp_path / "policy"), steps=3, prompts_per_step=8, group_size=4, max_new_tokens=16,
                kernel_mode="invariant", checkpoint_every=3, device="cuda", progress=False)
    held = train(TrainConfig(out_dir=str(tmp_path / "held"), **base))
    lent = train(TrainConfig(out_dir=str(tmp_path / "lent"), lend_kv_cache=True, **base))
    timing = held.metric.str.startswith("time_") | (held.metric == "tokens_per_s")
    assert (held[held.metric == "parity_tokens_differing"].value == 0).all()
    assert held[~timing].value.tolist() == lent[~timing].value.tolist()

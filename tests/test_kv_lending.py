"""The kept KV caches lent between rollouts (`DecodeGraphs.lend`) on CPU: the lend/return contract, and a call after
a lend and return has a fresh call's bits whatever the borrower left in the memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import same_completions

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.kernels import mode
from workbench.models import build


@pytest.fixture(scope="module")
def model():
    return build("tiny", dtype=torch.bfloat16, seed=1)


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# In standard mode the attention reads the keys and values past each row's length (masked, but NaN * 0 is NaN): a
# cache not zeroed after a lend changes its tokens there.
@pytest.mark.parametrize("kernels", ["standard", "invariant"])
def test_lent_caches_refuse_a_call_and_come_back_with_a_fresh_calls_bits(model, kernels):
    with mode(kernels):
        _lend_and_return(model)


def _lend_and_return(model):
    prompts = _prompts([6, 4], seed=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=4, seed=1)
    first = generate(model, prompts, params).completions[0].tokens[0]
    # Request 0 stops at its first token: the batch is compacted into a kept step of one row.
    stops = dataclasses.replace(params, stop_token_ids=(first,))
    # What today's kept caches give (in standard mode a cache's length, rounded up when kept, changes bits).
    fresh = generate(model, prompts, stops, keep=DecodeGraphs()).completions
    keep = DecodeGraphs(lendable=True)
    assert same_completions(generate(model, prompts, stops, keep=keep).completions, fresh)
    steps = keep.step(2), keep.step(1)
    keep.lend()
    assert all(s.cache.k.untyped_storage().nbytes() == 0 for s in steps), "lent: the caches' memory was released"
    with pytest.raises(RuntimeError, match=r"lent \(DecodeGraphs.lend\); call take_back\(\) first"):
        generate(model, prompts, stops, keep=keep)
    keep.take_back()
    # The memory comes back holding what the borrower wrote (an update's activations), not the generator's zeros.
    for s in steps:
        s.cache.k.fill_(float("nan"))
        s.cache.v.fill_(float("-inf"))
    assert same_completions(generate(model, prompts, stops, keep=keep).completions, fresh)
    assert (keep.step(2), keep.step(1)) == steps, "the kept steps (on a GPU: their captured graphs) were replayed"
    # Twice round: the contract holds from one rollout to the next.
    keep.lend()
    keep.take_back()
    assert same_completions(generate(model, prompts, stops, keep=keep).completions, fresh)


def test_lending_is_asked_for_and_paired():
    with pytest.raises(ValueError, match=r"not lendable; build it as DecodeGraphs\(lendable=True\)"):
        DecodeGraphs().lend()
    keep = DecodeGraphs(lendable=True)
    with pytest.raises(RuntimeError, match="nothing is lent"):
        keep.take_back()
    keep.lend()
    with pytest.raises(RuntimeError, match="lent already"):
        keep.lend()
    keep.clear()   # dropping the caches ends the lend: nothing is left to take back
    assert not keep.lent

"""The trainer's packed micro-batches (sequences end to end, no padding; `RolloutBatch.micro_batches(packed=True)`,
`CausalLM.hidden_states(packed=...)`): cut by real tokens; in `invariant` mode the log-probs are the padded
micro-batches' bits and the generator's, at any budget; the gradients are close to the padded ones (dW sums over
tokens grouped otherwise) and the same bits under activation checkpointing. Tiny model, interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import rel_err, seed_for
from workbench.generation import SamplingParams, generate
from workbench.kernels import mode
from workbench.models import RECOMPUTE, build
from workbench.rl.logprobs import completion_logprobs, packs, score
from workbench.rl.rollout import RolloutBatch
from workbench.rl.weights import TrainWeights

TEMPERATURE = 0.9


def _batch(seed: int, n: int, vocab: int = 512) -> RolloutBatch:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    comps = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    width = max(map(len, comps))
    mask = torch.zeros(n, width)
    for i, c in enumerate(comps):
        mask[i, : len(c)] = 1
    return RolloutBatch(prompts, comps, torch.zeros(n, width), mask, pad_id=0)


def _padded_logprobs(model, batch, budget):
    out = torch.zeros_like(batch.mask)
    for mb in batch.micro_batches(None, budget):
        out[mb.index, : mb.width] = completion_logprobs(model, mb, TEMPERATURE)[0]
    return out


def test_packed_micro_batches_count_real_tokens_and_cover_every_sequence_once():
    seed = seed_for()
    batch = _batch(seed, 11)
    lengths = [len(p) + len(c) for p, c in zip(batch.prompts, batch.completions)]
    for budget in (1, 17, 40, 10_000):
        mbs = batch.micro_batches(None, budget, packed=True)
        assert sorted(int(i) for mb in mbs for i in mb.index) == list(range(11)), f"seed {seed}"
        assert len(mbs) <= len(batch.micro_batches(None, budget)), f"seed {seed}: packing never cuts more"
        assert len(mbs) == len(batch.row_groups(None, budget, packed=True))
        for mb in mbs:
            n = sum(lengths[i] for i in mb.index.tolist())
            assert mb.ids.shape == (1, n) and (n <= budget or len(mb.index) == 1), f"seed {seed}: budget {budget}"
            cu = mb.packed.cu_seqlens.tolist()
            assert cu[0] == 0 and cu[-1] == n and mb.packed.max_len == max(lengths[i] for i in mb.index.tolist())
            for s, i in enumerate(mb.index.tolist()):   # the sequence's tokens, at their positions, in its span
                assert mb.ids[0, cu[s]:cu[s + 1]].tolist() == batch.prompts[i] + batch.completions[i], f"seed {seed}"
                assert mb.packed.positions[cu[s]:cu[s + 1]].tolist() == list(range(lengths[i]))
            targets = mb.ids[0, mb.positions + 1]
            assert torch.equal(targets, mb.targets), f"seed {seed}: a position does not predict its target"
            assert int(mb.targets.numel()) == int(batch.mask[mb.index].sum())


@pytest.fixture(scope="module")
def model():
    return build("tiny", dtype=torch.bfloat16, seed=1)


def test_packed_logprobs_are_the_padded_bits_and_the_generators(model):
    """Invariant mode: the trainer's log-probs through packed micro-batches (one, or cut at a small budget) are the
    padded micro-batches' bits and the sampled tokens' log-probs the generator reported."""
    seed = seed_for()
    rng = random.Random(seed)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (5, 9, 3, 7)]
    with mode("invariant"):
        out = generate(model, prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=6, seed=seed))
        batch = RolloutBatch.from_generation(prompts, out.completions, 0, "cpu")
        assert packs(model)
        whole = score(model, batch, 10_000, TEMPERATURE)[0]
        cut = score(model, batch, 16, TEMPERATURE)[0]
        padded = _padded_logprobs(model, batch, 10_000)
    with mode("standard"):   # a smoke bound: standard kernels' bits may follow the layout (what the project measures)
        std_packed, std_padded = score(model, batch, 16, TEMPERATURE)[0], _padded_logprobs(model, batch, 16)
    torch.testing.assert_close(std_packed, std_padded, atol=2e-2, rtol=0, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(std_packed, whole, atol=5e-2, rtol=0, msg=lambda m: f"seed {seed}: {m}")
    assert len(batch.micro_batches(None, 16, packed=True)) > 1, f"seed {seed}: the budget cuts nothing"
    assert torch.equal(whole, padded), f"seed {seed}: packed vs padded"
    assert torch.equal(cut, whole), f"seed {seed}: the packed split moved a bit"
    assert torch.equal(whole, batch.behavior), f"seed {seed}: trainer vs generator"


def _grads(weights, mb, recompute="none"):
    weights.zero_grad()
    with mode("invariant"):
        logp, _ = completion_logprobs(weights.model, mb, TEMPERATURE, recompute=recompute)
    (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
    return {k: m.grad.clone() for k, m in weights.masters.items()}


def test_packed_gradients_are_close_to_padded_and_recomputation_keeps_their_bits():
    """dW sums over a micro-batch's tokens, which packing puts in other rows of other tiles: close, not bitwise
    (fp32 master gradients of the bf16 model). Recomputing the MLP or whole layers gives the packed gradient's bits."""
    seed = seed_for()
    batch = _batch(seed, 3)
    weights = TrainWeights(build("tiny", device="cpu", dtype=torch.bfloat16, seed=3), "float32", 1e-3, "cpu")
    padded = _grads(weights, batch.micro_batches(None, 10_000)[0])
    mb = batch.micro_batches(None, 10_000, packed=True)[0]
    packed = {r: _grads(weights, mb, r) for r in RECOMPUTE}
    for k, g in padded.items():
        assert g.abs().sum() > 0 and rel_err(packed["none"][k], g) < 1e-5, f"seed {seed}: {k}"
        for r in RECOMPUTE[1:]:
            assert torch.equal(packed[r][k], packed["none"][k]), f"seed {seed}: {k}, recompute={r}"

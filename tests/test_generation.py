"""The embedded generator on CPU (tiny model, interpreter): the parity triangle bitwise, sampling, errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import same_completions, seed_for

from workbench.generation import (
    DecodeGraphs,
    SamplingParams,
    format_report,
    generate,
    keep_mask,
    parity_summary,
    parity_table,
    sampled_logprobs,
    trainer_logprobs,
    uniforms,
)
from workbench.generation.generator import CACHE_ROUND, compacted_size
from workbench.generation.sampling import KEYED_SEED, request_keys, sample
from workbench.kernels import FUSED_ROWWISE, mode
from workbench.models import build, copy_weights

PARAMS = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=5, seed=3)


# Session scope, not module: these tests run in the longest-first order of conftest.py, between other modules' tests,
# and pytest tears a module's fixtures down whenever the next test is another module's (`run` took 10-14 s each time).
@pytest.fixture(scope="session")
def model():
    return build("tiny", dtype=torch.bfloat16, seed=1)


def _prompts(lengths, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def run(model):
    prompts = _prompts([5, 9, 3, 7])
    return prompts, generate(model, prompts, PARAMS)


@pytest.mark.slow
def test_trainer_recomputes_the_generator_logprobs_bitwise(model, run):
    prompts, out = run
    tokens = [c.tokens for c in out.completions]
    raw = trainer_logprobs(model, prompts, tokens)
    table = parity_table([c.logprobs for c in out.completions], raw, tokens)
    assert parity_summary(table)["bitwise_identical"], format_report(table)
    sampled = trainer_logprobs(model, prompts, tokens, PARAMS)
    for t, c in zip(sampled, out.completions):
        assert torch.equal(t, c.sampled_logprobs)
        assert (c.sampled_logprobs >= c.logprobs).all(), "truncation renormalises: never less likely"


@pytest.mark.slow
def test_trainer_logprobs_do_not_depend_on_the_batch(model, run):
    prompts, out = run
    tokens = [c.tokens for c in out.completions]
    batch = trainer_logprobs(model, prompts, tokens)
    alone = trainer_logprobs(model, prompts[1:2], tokens[1:2])
    others = trainer_logprobs(model, [prompts[1]] + _prompts([11, 2], seed=5), [tokens[1], [1, 2, 3], [4]])
    assert torch.equal(alone[0], batch[1]) and torch.equal(others[0], batch[1])


@pytest.mark.slow
def test_a_request_alone_and_among_others_gets_the_same_tokens_and_logprobs(model, run):
    prompts, out = run
    needle = out.completions[2]
    alone = generate(model, [prompts[2]], PARAMS, request_ids=[2]).completions[0]
    crowd_prompts = _prompts([4, 12, 6], seed=9)
    crowd = generate(model, crowd_prompts[:2] + [prompts[2]] + crowd_prompts[2:], PARAMS,
                     request_ids=[10, 11, 2, 12]).completions[2]
    for other in (alone, crowd):
        assert other.tokens == needle.tokens
        assert torch.equal(other.logprobs, needle.logprobs)
        assert torch.equal(other.sampled_logprobs, needle.sampled_logprobs)


@pytest.mark.slow
def test_same_seed_same_output_other_seed_other_output(model, run):
    prompts, out = run
    again = generate(model, prompts, PARAMS)
    assert [c.tokens for c in again.completions] == [c.tokens for c in out.completions]
    other = generate(model, prompts, dataclasses.replace(PARAMS, seed=4))
    assert [c.tokens for c in other.completions] != [c.tokens for c in out.completions]


@pytest.mark.slow
def test_stop_tokens_compaction_and_kept_graphs_change_no_bits(model):
    prompts = _prompts([6, 4], seed=2)
    params = SamplingParams(temperature=0.8, max_new_tokens=4, seed=1)
    free = generate(model, prompts, params).completions
    stop_at = free[0].tokens[0]
    assert stop_at not in free[1].tokens[:1], "pick a seed whose second request does not stop at once"
    stops = dataclasses.replace(params, stop_token_ids=(stop_at,))
    stopped = generate(model, prompts, stops).completions
    assert stopped[0].tokens == [stop_at] and stopped[0].finish_reason == "stop"
    assert free[0].finish_reason == "length" and len(free[0].tokens) == 4
    # Request 0 left the batch after one token (the cache was compacted to request 1 alone).
    n = len(stopped[1].tokens)
    assert stopped[1].tokens == free[1].tokens[:n]
    assert torch.equal(stopped[1].logprobs, free[1].logprobs[:n])
    # Kept between calls: the first call fills `keep` (a cache rounded up in length, a step per compaction size),
    # the second reuses all of it, the third (other parameters) replaces it; each has a fresh call's bits.
    keep = DecodeGraphs()
    assert same_completions(generate(model, prompts, stops, keep=keep).completions, stopped)
    kept = keep.step(2), keep.step(1)
    assert kept[0].cache.max_len == CACHE_ROUND
    assert same_completions(generate(model, prompts, stops, keep=keep).completions, stopped)
    assert (keep.step(2), keep.step(1)) == kept
    assert same_completions(generate(model, prompts, params, keep=keep).completions, free)
    assert keep.step(2) is not kept[0]


def test_the_kept_view_follows_the_weights():
    """`DecodeGraphs` keeps the generator's view of the model (`DecodingModel`, over the packed weights) between
    calls: a weight update in place (`copy_weights`, as the weight sync does) is read through the same view, a
    replaced tensor (weights assigned, no longer packed) gets a new view; each call has the bits of a fresh call
    on the new weights (a stale view would sample with the old ones)."""
    model = build("tiny", dtype=torch.bfloat16, seed=1)
    prompts = _prompts([4, 2], seed=7)
    params = SamplingParams(temperature=0.9, max_new_tokens=2, seed=2)
    keep = DecodeGraphs()
    # Cloned: on a CPU a completion's log-probs are views of the kept record, which the next call overwrites.
    before = [c.logprobs.clone() for c in generate(model, prompts, params, keep=keep).completions]
    view = keep.decoding
    other = build("tiny", dtype=torch.bfloat16, seed=2)
    copy_weights(dict(other.state_dict()), model)
    after = generate(model, prompts, params, keep=keep).completions
    assert keep.decoding is view
    assert same_completions(after, generate(other, prompts, params).completions)
    assert not any(torch.equal(c.logprobs, lp) for c, lp in zip(after, before)), "the new weights change the bits"
    third = build("tiny", dtype=torch.bfloat16, seed=3)
    model.load_state_dict({k: v.clone() for k, v in third.state_dict().items()}, assign=True)
    assert model.model.layers[0].self_attn.packed() is None
    replaced = generate(model, prompts, params, keep=keep).completions
    assert keep.decoding is not view
    assert same_completions(replaced, generate(third, prompts, params).completions)


def test_request_keys_carry_the_seed_bit_for_bit():
    """The decode step samples with each row's key (`request_keys`: the seed folded into the request id) and
    KEYED_SEED, so one captured step serves every seed: the same draws and log-probs as the seed itself."""
    g = torch.Generator().manual_seed(13)
    logits = (torch.randn(6, 700, generator=g) * 3).bfloat16()
    ids, pos = torch.randint(0, 2**40, (6,), generator=g), torch.randint(0, 4096, (6,), generator=g)
    for params in (SamplingParams(seed=123456789, top_p=0.9), SamplingParams(seed=7, temperature=0.7, logit_noise=0.5)):
        want = sample(logits, params, ids, pos)
        got = sample(logits, dataclasses.replace(params, seed=KEYED_SEED), request_keys(params.seed, ids), pos)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        other = sample(logits, dataclasses.replace(params, seed=KEYED_SEED), request_keys(params.seed + 1, ids), pos)
        assert not torch.equal(other[0], want[0])


def test_compaction_halves_the_batch_while_the_live_rows_fit_in_half():
    sizes = {n: compacted_size(n, 64) for n in (1, 2, 3, 5, 17, 32, 33)}
    assert sizes == {1: 1, 2: 2, 3: 4, 5: 8, 17: 32, 32: 32, 33: 64}
    assert compacted_size(13, 48) == 24 and compacted_size(12, 48) == 12


def test_greedy_takes_the_argmax(model):
    prompts = _prompts([5], seed=3)
    out = generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=3)).completions[0]
    assert (out.sampled_logprobs == 0).all()
    logits = model(torch.tensor([prompts[0] + out.tokens]))[0].float()
    assert out.tokens == logits[len(prompts[0]) - 1 : -1].argmax(-1).tolist()


def test_keep_mask_top_k_and_top_p():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4)) * 3
    k = keep_mask(logits, SamplingParams(top_k=17))
    assert (k.sum(-1) == 17).all()
    p = SamplingParams(top_p=0.8, temperature=0.7)
    keep = keep_mask(logits, p)
    probs = torch.softmax(logits.double() / 0.7, -1)
    kept = (probs * keep).sum(-1)
    assert (kept >= 0.8 - 1e-6).all()
    smallest = torch.where(keep, probs, torch.inf).min(-1).values
    assert (kept - smallest < 0.8 + 1e-6).all(), "top-p keeps no token it does not need"
    assert keep_mask(logits, SamplingParams()) is None


@pytest.mark.parametrize("kernels", ["invariant", "standard"])
def test_top_k_then_top_p_keeps_hugging_faces_set(kernels):
    """top-k with top-p: top-p cuts the top-k distribution renormalised, as Hugging Face's TopKLogitsWarper then
    TopPLogitsWarper (and vLLM) do, on random logits: the same kept set, row by row whatever the batch. A token on
    which the two disagree may only be one whose preceding (renormalised) mass is top_p up to the fp32 sums."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    seed = seed_for()
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(seed)) * 3
    renormalised_cut = False
    for top_k, top_p, temperature in ((20, 0.9, 1.0), (50, 0.7, 0.7), (5, 0.95, 1.3), (300, 0.8, 1.0)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        with mode(kernels):
            keep = keep_mask(logits, params)
            alone = [keep_mask(logits[i:i + 1], params) for i in range(len(logits))]
        assert all(torch.equal(a, keep[i:i + 1]) for i, a in enumerate(alone)), f"seed {seed}: a row alone differs"
        x = TemperatureLogitsWarper(temperature)(None, logits.clone())
        hf = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, x)).isfinite()
        probs = torch.softmax(logits.double() / temperature, -1)
        top = probs * (logits >= logits.topk(top_k, -1).values[:, -1:])
        top = top / top.sum(-1, keepdim=True)
        # before[b, j]: the mass of the more likely tokens than j in the renormalised top-k distribution (fp64)
        before = (top.unsqueeze(-2) * (top.unsqueeze(-2) > top.unsqueeze(-1))).sum(-1)
        differ = keep != hf
        assert ((before[differ] - top_p).abs() < 1e-5).all(), \
            f"seed {seed}, {params}: {int(differ.sum())} tokens kept by one definition only"
        # The case the renormalisation decides: top-k's mass below top_p, yet top-p cuts into the top-k.
        renormalised_cut |= bool(((probs * keep).sum(-1) < top_p).logical_and(keep.sum(-1) < min(top_k, 300)).any())
    assert renormalised_cut, f"seed {seed}: no row where the renormalisation matters; the test proved nothing"


def test_uniforms_stay_strictly_inside_the_unit_interval():
    from workbench.generation.sampling import unit_interval

    u = unit_interval(torch.tensor([0, 1, 2**31, 2**32 - 1]))
    assert (u > 0).all() and (u < 1).all() and torch.isfinite(-torch.log(-torch.log(u))).all()


def test_random_numbers_depend_only_on_seed_request_and_position():
    u = uniforms(7, torch.tensor([3, 5]), torch.tensor([10, 0]), 1000)
    assert ((u > 0) & (u < 1)).all() and abs(u.mean().item() - 0.5) < 0.02
    assert torch.equal(uniforms(7, torch.tensor([5]), torch.tensor([0]), 1000)[0], u[1])
    assert not torch.equal(uniforms(8, torch.tensor([5]), torch.tensor([0]), 1000)[0], u[1])


@pytest.mark.slow
def test_gumbel_sampling_follows_the_softmax():
    from workbench.generation import sample

    n = 1600  # each draw is an interpreted program: the frequencies' standard error is at most 0.0125
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5, 1.5, -0.5, 0.2]]).repeat(n, 1)
    params = SamplingParams(temperature=0.8, seed=2)
    tokens, _, _ = sample(logits, params, torch.zeros(n, dtype=torch.long), torch.arange(n))
    freq = torch.bincount(tokens, minlength=8).double() / n
    want = torch.softmax(logits[0].double() / 0.8, -1)
    assert (freq - want).abs().max() < 0.045, "about 3.6 standard errors"


@pytest.mark.parametrize("kernels", ["invariant", "standard"])
def test_sampled_logprobs_are_the_samplers_distributions_at_every_temperature(kernels):
    """`sample`'s third output is `sampled_logprobs` of its tokens, bit for bit: at temperature 1 without
    truncation it reuses the raw log-probs (the same distribution), elsewhere it computes them; fresh logits."""
    logits = (torch.randn(6, 300) * 3).bfloat16()
    req, pos = torch.arange(6), torch.full((6,), 3)
    with mode(kernels):
        for params in (SamplingParams(temperature=1.0, seed=4), SamplingParams(temperature=0.7, seed=4),
                       SamplingParams(temperature=1.0, top_k=20, seed=4)):
            tokens, raw, sampled = sample(logits, params, req, pos)
            assert torch.equal(sampled, sampled_logprobs(logits, tokens, params)), params
            assert torch.equal(raw, sampled) == (params.temperature == 1.0 and not params.top_k), params


def test_standard_mode_report_measures_the_mismatch(model):
    prompts = _prompts([4, 6], seed=6)
    with mode("standard"):
        out = generate(model, prompts, PARAMS)
        tokens = [c.tokens for c in out.completions]
        table = parity_table([c.logprobs for c in out.completions], trainer_logprobs(model, prompts, tokens), tokens)
    s = parity_summary(table)
    assert s["tokens"] == sum(map(len, tokens))
    assert "bitwise identical:" in format_report(table)
    # The report must see a mismatch where one is certain: the generator's log-probs nudged by one fp32 ulp.
    nudged = [torch.nextafter(c.logprobs, torch.zeros_like(c.logprobs)) for c in out.completions]
    off = parity_summary(parity_table(nudged, [c.logprobs for c in out.completions], tokens))
    assert off["tokens_differing"] == off["tokens"] and not off["bitwise_identical"] and off["max_abs_diff"] > 0


@pytest.mark.slow
def test_fast_standard_baseline_samples_close_to_the_trainer(model):
    """The fast standard baseline (`mode("standard", **FUSED_ROWWISE)`): standard matmuls and attention, the fused
    row-wise kernels, and on the generation path the fused RoPE + KV-cache write. Its completions' log-probs agree
    with the same mode's trainer to bf16 rounding (the mismatch is kernels', never a wiring error)."""
    prompts = _prompts([4, 11, 7], seed=8)
    with mode("standard", **FUSED_ROWWISE):
        out = generate(model, prompts, PARAMS)
        tokens = [c.tokens for c in out.completions]
        s = parity_summary(parity_table([c.logprobs for c in out.completions],
                                        trainer_logprobs(model, prompts, tokens), tokens))
    assert s["tokens"] == sum(map(len, tokens)) > 0 and s["max_abs_diff"] < 0.05, s


def test_bad_requests_are_refused(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], PARAMS)
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 600]], PARAMS)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        generate(model, [[1] * 10], dataclasses.replace(PARAMS, max_new_tokens=600))
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [], PARAMS)
    with pytest.raises(TypeError, match="keep must be a DecodeGraphs"):
        generate(model, [[1, 2]], PARAMS, keep={})
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_fused_gumbel_draw_is_the_pytorch_formula_and_row_invariant():
    from workbench.kernels import gumbel_argmax
    from workbench.kernels.gumbel import gumbel_argmax_reference

    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(48, 1000, generator=g) * 3).bfloat16()
    req, pos = torch.randint(0, 10**6, (48,), generator=g), torch.randint(0, 4096, (48,), generator=g)
    keep = torch.rand(48, 1000, generator=g) < 0.7
    for t, k in ((1.0, None), (0.6, None), (1.3, keep)):
        got = gumbel_argmax(logits, t, 5, req, pos, k)
        u = uniforms(5, req, pos, 1000)
        want = gumbel_argmax_reference(logits, t, u, k)
        # The contract: the same draw up to fp32 rounding of the log (GPU's or numpy's vs torch's), so a row may
        # differ only where the two winners' scores are a near tie under the reference's arithmetic.
        score = logits.float() / t - torch.log(-torch.log(u))
        if k is not None:
            score = score.masked_fill(~k, float("-inf"))
        rows = torch.arange(48)
        gap = (score[rows, want] - score[rows, got]).abs()
        assert (gap[got != want] <= 1e-5 * score[rows, want].abs().clamp_min(1.0)[got != want]).all(), \
            f"temperature {t}: a draw differs beyond a near tie"
        assert (got == want).float().mean() >= 0.9, f"temperature {t}: most draws are the reference's"
        alone = gumbel_argmax(logits[9:10], t, 5, req[9:10], pos[9:10], None if k is None else k[9:10])
        assert alone.item() == got[9].item()
        if k is not None:
            assert k[torch.arange(48), got].all(), "only kept entries are drawn"
    assert not torch.equal(gumbel_argmax(logits, 1.0, 6, req, pos), gumbel_argmax(logits, 1.0, 5, req, pos))
    # One position broadcast to every row (stride 0, as a decode step passes it) and ids read through a stride.
    step = torch.tensor(7).expand(48)
    wide = torch.stack([req, req], 1)[:, 0]
    assert torch.equal(gumbel_argmax(logits, 1.0, 5, wide, step),
                       gumbel_argmax(logits, 1.0, 5, req.clone(), torch.full((48,), 7)))


def test_the_draw_stays_in_its_row_on_nan_logits():
    """NaN logits (a broken forward, caught by the parity check downstream): a row's chunk maxima are then NaN and
    equal none of them, and the draw takes its first chunk's pick, never an index read past the row (the last
    row's would be past the buffer, another row's would be that row's token)."""
    from workbench.kernels import gumbel_argmax
    from workbench.kernels.runtime import width_block

    seed = seed_for()
    # A whole number of chunks: no padding entry (-inf) in any chunk, so every chunk maximum of a NaN row is NaN.
    logits = torch.randn(4, 1024, generator=torch.Generator().manual_seed(seed)).bfloat16()
    logits[1] = float("nan")
    logits[3] = float("nan")
    req, pos = torch.arange(4), torch.full((4,), 7)
    tokens = gumbel_argmax(logits, 1.0, 5, req, pos)
    chunk = width_block(1024, 4096, 256)
    assert chunk < 1024 and 1024 % chunk == 0, "the row must span several whole chunks"
    first = gumbel_argmax(logits[:, :chunk], 1.0, 5, req, pos)     # one chunk a row: its pick is the token
    assert tokens[1] == first[1] and tokens[3] == first[3], f"seed {seed}: {tokens.tolist()} vs {first.tolist()}"
    assert not torch.isnan(logits[[0, 2]]).any() and ((tokens[[0, 2]] >= 0) & (tokens[[0, 2]] < 1024)).all()


def unit_temperature_chunks(logits, seed=5):
    """The draw's per-chunk maxima and picks at T = 1, with the division left out and with it kept."""
    from workbench.kernels.runtime import width_block
    from workbench.kernels.gumbel import _gumbel_chunk_kernel, seed_hash

    r, v = logits.shape
    block = width_block(v, 4096, 256)
    n = -(-v // block)
    req = torch.arange(r, device=logits.device) * 7919
    pos = torch.arange(r, device=logits.device) % 300
    out = []
    for unit in (True, False):
        best = torch.empty((r, n), device=logits.device, dtype=torch.float32)
        idx = torch.empty((r, n), device=logits.device, dtype=torch.int64)
        _gumbel_chunk_kernel[(r, n)](logits, logits, req, pos, best, idx, logits.stride(0), 0, v, n, seed_hash(seed),
                                     1.0, HAS_KEEP=False, UNIT_T=unit, BLOCK_V=block, PDL=False, num_warps=4)
        out.append((best, idx))
    return out


def test_the_draw_leaves_out_the_division_at_unit_temperature_bit_for_bit():
    """x / 1 is x in IEEE arithmetic, so the T = 1 draw that skips the division has the dividing draw's bits,
    NaN, inf and subnormal logits included."""
    seed = seed_for()
    logits = (torch.randn(4, 1024, generator=torch.Generator().manual_seed(seed)) * 30).bfloat16()
    logits[0, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0])
    (b1, i1), (b2, i2) = unit_temperature_chunks(logits)
    assert torch.equal(b1.view(torch.int32), b2.view(torch.int32)) and torch.equal(i1, i2), f"seed {seed}"


def test_logit_noise_perturbs_the_sampled_distribution_row_by_row():
    """The dose-response knob on CPU (the PyTorch path): the draw and both log-probs are those of
    logits + sigma x z with z hashed from (seed, request, position, v); a row's result is the same alone."""
    from workbench.generation import sample
    from workbench.generation.sampling import _NOISE_SALT

    seed = seed_for()
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(seed)) * 2
    req, pos = torch.tensor([3, 1, 4, 1, 5]), torch.tensor([0, 2, 7, 1, 8])
    params = SamplingParams(temperature=1.0, seed=11, logit_noise=0.5)
    tokens, raw, smp = sample(logits, params, req, pos)
    z = torch.special.ndtri(uniforms(11, req, pos, 300, _NOISE_SALT))
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05, "z ~ N(0, 1)"
    want = torch.log_softmax(logits + 0.5 * z, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(raw, want, atol=1e-5) and torch.equal(raw, smp), f"seed {seed}"
    alone = sample(logits[2:3], params, req[2:3], pos[2:3])
    assert torch.equal(alone[0], tokens[2:3]) and torch.equal(alone[1], raw[2:3]), f"seed {seed}"
    clean = sample(logits, SamplingParams(temperature=1.0, seed=11), req, pos)[1]
    assert not torch.equal(clean, raw), f"seed {seed}"
    with pytest.raises(ValueError, match="logit_noise"):
        SamplingParams(logit_noise=-0.1)

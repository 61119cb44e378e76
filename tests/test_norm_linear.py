"""`rms_norm_linear` and `rms_norm_swiglu_product`: the residual add and RMSNorm in the prologue of the product that
reads the normalised rows, the bits of `rms_norm_add` then `linear` (or `swiglu_product`'s unfused ops) in the
interpreter (fresh random inputs, the seed in the message), and the decoding model that runs them gives the training
forward's tokens and log-probs; the GPU tests hold them on the device."""

import pytest
import torch

from helpers import count_fused_calls, rel_err, seed_for, tolerance
from workbench.kernels import (
    linear, mode, rms_norm, rms_norm_add, rms_norm_linear, rms_norm_qkv_rope_cache, rms_norm_swiglu_product, silu_mul,
)
from workbench.kernels.norm_linear import rms_norm_linear_reference
from workbench.kernels.swiglu_product import rms_norm_swiglu_product_reference


def _inputs(device, rows, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x, res = ((torch.randn(rows, k, generator=g) * 3).to(**bf16) for _ in range(2))
    norm_w = (1 + 0.2 * torch.randn(k, generator=g)).to(**bf16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(**bf16)
    return x, res, norm_w, w


def _unfused(x, res, norm_w, w, eps, swiglu=False):
    y, h = (rms_norm(x, norm_w, eps), x) if res is None else rms_norm_add(x, res, norm_w, eps)
    if swiglu:
        gate, up = w.chunk(2)
        return silu_mul(linear(y, gate), linear(y, up)), h
    return linear(y, w), h


def check_norm_product(device, rows, k, n, residual=True, eps=1e-5, swiglu=False):
    """The fused kernel (`rms_norm_swiglu_product` with swiglu, n = 2 I) against `rms_norm_add` (`rms_norm` without
    a residual) then the product (`silu_mul` of gate's and up's) in invariant mode, bitwise, product and stream; a
    row alone gives its bits in the batch; close to fp64."""
    seed = seed_for()
    x, res, norm_w, w = _inputs(device, rows, k, n, seed)
    res = res if residual else None
    r = rows // 2
    fused = rms_norm_swiglu_product if swiglu else rms_norm_linear
    with mode("invariant"):
        got = fused(x, res, norm_w, w, eps)
        want = _unfused(x, res, norm_w, w, eps, swiglu)
        alone = fused(x[r : r + 1], None if res is None else res[r : r + 1], norm_w, w, eps)
    width = n // 2 if swiglu else n
    assert got is not None and got[0].shape == (rows, width) and got[1].shape == (rows, k), f"seed {seed}"
    assert torch.equal(got[0], want[0]), f"seed {seed}: the fused product differs from the norm then the product"
    assert torch.equal(got[1], want[1]), f"seed {seed}: the stream differs from rms_norm_add's"
    assert torch.equal(alone[0][0], got[0][r]), f"seed {seed}: a row alone differs from the same in the batch"
    ref = (rms_norm_swiglu_product_reference if swiglu else rms_norm_linear_reference)(x, res, norm_w, w, eps)[0]
    roundings = 6 if swiglu else 3  # the norm's two, then the product's one, or gate, silu, up and their product
    assert rel_err(got[0], ref) < roundings / 1.5 * tolerance(torch.bfloat16, device == "cuda"), \
        f"seed {seed}: far from fp64"


@pytest.mark.parametrize("rows,k,n,residual,swiglu", [
    (5, 96, 80, True, False),       # K and N tails, one row tile
    (37, 576, 960, True, False),    # SmolLM2's q/k/v: two row tiles (the last ragged), four column tiles (ragged)
    (4, 576, 960, False, False),    # the first layer: no residual, the stream is the embeddings
    (5, 96, 80, True, True),        # gate/up + silu_mul: tails
    (3, 576, 3072, True, True),     # SmolLM2's gate/up
], ids=["tails", "smollm2-qkv", "no-residual", "swiglu-tails", "smollm2-gate-up"])
def test_fused_is_the_bits_of_the_norm_then_the_product(rows, k, n, residual, swiglu):
    check_norm_product("cpu", rows, k, n, residual, swiglu=swiglu)


def test_the_comparison_sees_another_reduction_order():
    """Negative controls: a norm whose sum of squares is taken in another order (sequential, each row in fp32),
    rounded at the same points, then the same product, differs from the fused kernel somewhere; so does the
    standard mode's norm and product. Bitwise equality above is a claim the test can fail."""
    seed = seed_for()
    eps = 1e-5
    x, res, norm_w, w = _inputs("cpu", 37, 576, 960, seed)
    with mode("invariant"):
        got = rms_norm_linear(x, res, norm_w, w, eps)[0]
        h = (x.float() + res.float()).bfloat16().float()
        rstd = 1.0 / torch.sqrt(torch.cumsum(h * h, -1)[:, -1:] / h.shape[1] + eps)
        other = linear(((h * rstd).bfloat16().float() * norm_w.float()).bfloat16(), w)
    assert not torch.equal(got, other), f"seed {seed}: a sequential sum of squares gave the same bits"
    with mode("standard"):
        standard = _unfused(x, res, norm_w, w, eps)[0]
    assert not torch.equal(got, standard), f"seed {seed}: the standard norm and product gave the same bits"


def test_where_it_does_not_apply_the_caller_is_told():
    x, res, norm_w, w = _inputs("cpu", 3, 64, 32, seed=0)
    assert rms_norm_linear(x.float(), res.float(), norm_w.float(), w.float()) is None, "fp32: the unfused ops"
    assert rms_norm_linear(x, res, norm_w, w[:, :32]) is None, "K differs"
    assert rms_norm_linear(x, res[:2], norm_w, w) is None, "x and residual differ in shape"


def test_decoding_with_the_fusion_gives_the_trainers_tokens_and_logprobs(monkeypatch):
    """`generate` on the tiny model, whose decoding view runs every layer's q/k/v and gate/up products with the norm
    in their prologue, the q/k/v product with q/k's norm, RoPE and the cache write in its epilogue too
    (`rms_norm_qkv_rope_cache`, Qwen3's q/k norm; counted, never `rms_norm_linear` then `rope_cache_write`): the
    trainer's recomputed log-probs are the generator's, bit for bit."""
    from workbench.generation import SamplingParams, generate, trainer_logprobs
    from workbench.models import build
    from workbench.models import decoding

    calls = count_fused_calls(monkeypatch, decoding,
                              ("rms_norm_linear", "rms_norm_qkv_rope_cache", "rms_norm_swiglu_product"))
    model = build("tiny", dtype=torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(seed_for())
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 7)]
    params = SamplingParams(temperature=0.9, max_new_tokens=3, seed=3)
    with mode("invariant"):
        out = generate(model, prompts, params, cuda_graphs=False)
        tokens = [c.tokens for c in out.completions]
        raw = trainer_logprobs(model, prompts, tokens)
        sampled = trainer_logprobs(model, prompts, tokens, params)
    assert set(calls) == {"rms_norm_qkv_rope_cache", "rms_norm_swiglu_product"} and all(map(all, calls.values())), \
        f"the decoding view did not run the fused norms and products every time: {calls}"
    for c, t, s in zip(out.completions, raw, sampled):
        assert torch.equal(t, c.logprobs), "the trainer's log-probs differ from the generator's"
        assert torch.equal(s, c.sampled_logprobs), "the trainer's sampled log-probs differ from the generator's"

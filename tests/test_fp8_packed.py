"""The fp8 sampler's q/k/v and gate/up codes laid out in one buffer per group (generation/fp8.py's `_Group`): the
decoding view runs each group as one W8A8 product over one quantized input, on the bf16 engine's paths (the fused
rope and cache write included), and gives the bits of each projection's own product on the CPU.

What is exact on the CPU: the quantization (one input: the same codes and scales, packed or not) and the codes'
products (4 significant bits each: exact in fp32); the fp32 sums are the CPU BLAS's, whose order for one output
column does not follow the product's width here, which these tests assert bitwise. On a GPU `torch._scaled_mm`
may sum in another order for a wider product (the contract allows only that), so there the check is a tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench.generation import SamplingParams, generate
from workbench.generation.fp8 import Fp8Sampler
from workbench.kernels import FUSED_ROWWISE, mode
from workbench.models import build, decoding, transformer
from workbench.models.config import config
from workbench.models.decoding import DecodingModel
from workbench.models.transformer import KVCache

TINY = config("tiny")
SHAPES = {"qwen3": TINY, "qwen2-bias": dataclasses.replace(TINY, model_type="qwen2", qk_norm=False,
                                                             attention_bias=True)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _step(sampler: Fp8Sampler, device: str):
    """Logits of a prefill over 3 sequences: through the decoding view, and through the model's own forward."""
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, TINY.vocab_size, (3, 9), generator=g).to(device)
    lens = torch.tensor([9, 4, 7], dtype=torch.int32, device=device)
    zero = torch.zeros(3, dtype=torch.int32, device=device)

    def cache():
        return KVCache.allocate(sampler.model.config, 3, 9, device, dtype=torch.bfloat16)

    view = DecodingModel(sampler.model)
    return view, view(ids, lens, cache(), zero), sampler.model(ids, seq_lens=lens, cache=cache(), start=zero)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_decoding_views_packed_fp8_products_are_the_separate_ones(shape, device):
    source = build(SHAPES[shape], dtype=torch.bfloat16, seed=13, device=device)
    with mode("standard", **FUSED_ROWWISE), torch.no_grad():
        sampler = Fp8Sampler(source)
        view, packed, separate = _step(sampler, device)
    for attn, mlp in view.static:
        assert isinstance(attn, decoding._PackedAttention) and type(mlp) is decoding._PackedMLP, shape
    if device == "cpu":
        assert torch.equal(packed, separate), shape
    else:
        torch.testing.assert_close(packed.float(), separate.float(), atol=5e-2, rtol=5e-2)


def test_a_view_built_before_load_reads_the_new_codes():
    """`load` refills the group buffers in place: a view (and a decode graph captured over it) sees the new
    weights, with the bits of a view built after."""
    source = build("tiny", dtype=torch.bfloat16, seed=5)
    with mode("standard", **FUSED_ROWWISE), torch.no_grad():
        sampler = Fp8Sampler(source)
        old_view, _, _ = _step(sampler, "cpu")
        for p in source.parameters():
            p.mul_(-1.25)
        sampler.load(source)
        _, want, _ = _step(sampler, "cpu")
        cache = KVCache.allocate(sampler.model.config, 3, 9, "cpu", dtype=torch.bfloat16)
        ids = torch.randint(0, TINY.vocab_size, (3, 9), generator=torch.Generator().manual_seed(14))
        got = old_view(ids, torch.tensor([9, 4, 7], dtype=torch.int32), cache, torch.zeros(3, dtype=torch.int32))
    assert torch.equal(got, want)


def test_fp8_generation_is_the_same_packed_or_not(monkeypatch):
    """`generate` with the fp8 sampler: the same tokens and log-probs, bitwise, whether its view runs the packed
    products or (weights seen unpacked) each projection's own module."""
    source = build("tiny", seed=1)
    sampler = Fp8Sampler(source)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    params = SamplingParams(max_new_tokens=6, seed=2)
    with mode("standard", **FUSED_ROWWISE):
        packed = generate(sampler.model, prompts, params)
        monkeypatch.setattr(transformer, "packed_projections", lambda projs: None)
        assert DecodingModel(sampler.model).static[0][0].__class__ is decoding._SeparateAttention
        separate = generate(sampler.model, prompts, params)
    for a, b in zip(packed.completions, separate.completions):
        assert a.tokens == b.tokens
        assert torch.equal(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs))

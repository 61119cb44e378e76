"""gumbel_argmax, the sampler's draw: the token of the PyTorch form over the same hashed uniforms, a row's token
its own whatever the batch, `keep` respected; on CPU (the interpreter) and on a GPU. The sampler's statistics are
tests/test_generation.py's."""

from __future__ import annotations

import pytest
import torch

from helpers import seed_for
from workbench.kernels import gumbel_argmax
from workbench.kernels.gumbel import gumbel_argmax_reference, uniforms

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("vocab", [600, 151936])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("device", DEVICES)
def test_draws_are_the_pytorch_forms_and_row_invariant(device, temperature, vocab):
    if device == "cpu" and vocab > 10_000:
        pytest.skip("a vocabulary-wide row (several chunks) is the GPU's case")
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(13, vocab, generator=g)).bfloat16().to(device)
    ids = torch.randint(0, 2**31, (13,), generator=g).to(device)
    pos = torch.randint(0, 4096, (13,), generator=g).to(device)
    keep = (torch.rand(13, vocab, generator=g) < 0.5).to(device)
    for k in (None, keep):
        tokens = gumbel_argmax(logits, temperature, seed, ids, pos, k)
        want = gumbel_argmax_reference(logits, temperature, uniforms(seed, ids, pos, vocab), k)
        assert torch.equal(tokens, want), f"seed {seed}"
        alone = gumbel_argmax(logits[5:6], temperature, seed, ids[5:6], pos[5:6], None if k is None else k[5:6])
        assert torch.equal(alone, tokens[5:6]), f"seed {seed}: a row alone"
    assert bool(keep.gather(1, tokens[:, None]).all()), f"seed {seed}: a token `keep` left out"

"""logsumexp and logprob_rows, which follow `token_logprobs`' mode: in invariant mode the bits the log-prob kernel
uses (so a sampler reports the trainer's log-probs), accurate against fp64, row-invariant; on CPU (the
interpreter) and on a GPU."""

from __future__ import annotations

import pytest
import torch

from helpers import seed_for
from workbench.kernels import logprob_rows, logsumexp, mode, token_logprobs
from workbench.kernels.logprobs import logprob_rows_reference, logsumexp_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _logits(device, seed, rows=11, vocab=600):
    return (4 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))).bfloat16().to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_rows_are_token_logprobs_bits(device):
    seed = seed_for()
    x = _logits(device, seed)
    tokens = torch.randint(0, x.shape[1], (x.shape[0],), generator=torch.Generator().manual_seed(seed)).to(device)
    with mode("invariant"):
        rows = logprob_rows(x, 0.8)
        lse = logsumexp(x, 0.8)
        assert torch.equal(rows.gather(1, tokens[:, None])[:, 0], token_logprobs(x, tokens, 0.8)), f"seed {seed}"
        assert torch.equal(logsumexp(x[3:4], 0.8), lse[3:4]), f"seed {seed}: a row alone"
        assert torch.equal(logprob_rows(x[3:4], 0.8), rows[3:4]), f"seed {seed}: a row alone"
    assert (lse.double() - logsumexp_reference(x, 0.8)).abs().max() < 1e-5 * lse.abs().max(), f"seed {seed}"
    assert (rows.double() - logprob_rows_reference(x, 0.8)).abs().max() < 1e-4, f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
def test_standard_mode_is_torchs(device):
    seed = seed_for()
    x = _logits(device, seed)
    with mode("invariant", token_logprobs="standard"):
        assert torch.equal(logsumexp(x, 0.8), torch.logsumexp(x.float() / 0.8, -1)), f"seed {seed}"
        assert torch.equal(logprob_rows(x, 0.8), torch.log_softmax(x.float() / 0.8, -1)), f"seed {seed}"

"""The trainer's update on a real GPU at the Qwen3-1.7B shape (random weights): the fused log-probs are the
generator's bits, a token's log-prob does not depend on its micro-batch, activation checkpointing keeps the
gradient bits (with the backward on autograd's device thread), and the standard control differs; at the
SmolLM2-135M shape with the regime's lengths, packed micro-batches give the padded ones' log-prob bits."""

from __future__ import annotations

import pytest
import torch
from helpers import random_gpu_model

from workbench.kernels import linear, linear_logprobs, mode, token_logprobs
from workbench.models import RECOMPUTE
from workbench.rl.logprobs import completion_logprobs, score
from workbench.rl.rollout import RolloutBatch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return random_gpu_model()


def _batch(seed: int, n: int = 24) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 200, (n, 2), generator=g).tolist()
    prompts = [torch.randint(0, 151936, (p,), generator=g).tolist() for p, _ in lens]
    comps = [torch.randint(0, 151936, (c,), generator=g).tolist() for _, c in lens]
    width = max(map(len, comps))
    mask = torch.zeros(n, width)
    for i, c in enumerate(comps):
        mask[i, : len(c)] = 1
    return RolloutBatch(prompts, comps, torch.zeros(n, width, device="cuda"), mask.cuda(), pad_id=0)


def test_fused_logprobs_are_the_generators_bits_at_any_chunk():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(3000, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(151936, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    tok = torch.randint(0, 151936, (3000,), device="cuda", generator=g)
    with mode("invariant"):
        want = token_logprobs(linear(h, w), tok, 0.7)
        for chunk in (1, 333, 1024, 4096):
            got, _ = linear_logprobs(h, w, tok, 0.7, chunk_rows=chunk)
            assert torch.equal(got, want), f"chunk_rows={chunk}"
        assert torch.equal(linear_logprobs(h[:5], w, tok[:5], 0.7)[0], want[:5])
    with mode("standard"):
        std, _ = linear_logprobs(h, w, tok, 0.7)
    assert not torch.equal(std, want), "the standard control must differ from the invariant path"
    torch.testing.assert_close(std, want, atol=0.1, rtol=0)


def test_logprobs_do_not_depend_on_the_micro_batch_split(model):
    batch = _batch(2)
    with mode("invariant"):
        full, _ = score(model, batch, 1 << 20, 1.0)
        for budget in (256, 1000, 4096):
            assert torch.equal(score(model, batch, budget, 1.0)[0], full), f"budget {budget}"
    with mode("standard"):
        std = [score(model, batch, budget, 1.0)[0] for budget in (256, 1 << 20)]
    real = batch.mask.bool()
    assert not torch.equal(std[0][real], full[real]), "standard kernels differ from the invariant ones"
    assert not torch.equal(std[0][real], std[1][real]), "standard: the split changes a token's log-prob"


def test_the_update_forward_gives_the_scoring_bits(model):
    """The ratio's numerator (a forward with autograd recording, no entropy) equals its denominator (the no-grad
    scoring pass, with entropy) bit for bit: the first mini-batch's ratio is exactly 1."""
    batch = _batch(4, n=8)
    with mode("invariant"):
        scored, _ = score(model, batch, 1 << 20, 0.8, with_entropy=True)
        mb = batch.micro_batches(None, 1 << 20)[0]
        logp, _ = completion_logprobs(model, mb, 0.8)
    got = torch.zeros_like(scored)
    got[mb.index, : mb.width] = logp.detach()
    real = batch.mask.bool()
    assert torch.equal(got[real], scored[real]), f"{int((got != scored)[real].sum())} tokens differ"


@pytest.mark.parametrize("kernel_mode", ["invariant", "standard"])
def test_activation_checkpointing_keeps_the_gradient_bits(model, kernel_mode):
    mb = _batch(3, n=4).micro_batches(None, 1 << 20)[0]
    grads = {}
    for recompute in RECOMPUTE:
        model.zero_grad(set_to_none=True)
        with mode(kernel_mode):
            logp, _ = completion_logprobs(model, mb, 1.0, recompute=recompute)
            weights = torch.linspace(-1, 1, logp.numel(), device="cuda").view_as(logp)
        (logp * weights).sum().backward()   # outside the mode: the recomputation must still use the forward's
        grads[recompute] = {k: p.grad.clone() for k, p in model.named_parameters()
                            if "layers.0." in k or "layers.27" in k}
    model.zero_grad(set_to_none=True)
    for recompute in RECOMPUTE[1:]:
        for k in grads["none"]:
            assert torch.equal(grads["none"][k], grads[recompute][k]), f"{k} ({recompute})"


@pytest.fixture(scope="module")
def small():
    return random_gpu_model("smollm2-135M")


def _mixed(seed: int, n: int = 32, vocab: int = 49152) -> RolloutBatch:
    """The regime's lengths: prompts ~80 tokens, completions a third at 1,024, the rest uniform."""
    g = torch.Generator().manual_seed(seed)
    comp = torch.randint(1, 1025, (n,), generator=g)
    comp[torch.randperm(n, generator=g)[: n // 3]] = 1024
    prompts = [torch.randint(0, vocab, (int(torch.randint(60, 100, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    comps = [torch.randint(0, vocab, (int(c),), generator=g).tolist() for c in comp]
    mask = (torch.arange(1024)[None, :] < comp[:, None]).float().cuda()
    return RolloutBatch(prompts, comps, torch.zeros_like(mask), mask, pad_id=0)


def test_packed_micro_batches_are_the_padded_bits_at_the_smollm2_shape(small):
    """SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64), the regime's lengths: the log-probs through packed
    micro-batches (`score`'s, at several budgets) are the padded micro-batches' bits in invariant mode; the
    gradients are close (dW's sums group the tokens otherwise) and activation checkpointing keeps the packed
    gradient's bits; standard mode differs (the control)."""
    batch = _mixed(5)
    real = batch.mask.bool()
    with mode("invariant"):
        padded = torch.zeros_like(batch.mask)
        for mb in batch.micro_batches(None, 16384):
            padded[mb.index, : mb.width] = completion_logprobs(small, mb, 1.0)[0]
        for budget in (4096, 16384, 1 << 20):
            packed, _ = score(small, batch, budget, 1.0)
            assert torch.equal(packed[real], padded[real]), f"budget {budget}: " \
                f"{int((packed != padded)[real].sum())} tokens differ"
    with mode("standard"):
        std, _ = score(small, batch, 16384, 1.0)
    assert not torch.equal(std[real], padded[real]), "standard kernels differ from the invariant ones"
    few = _mixed(6, n=6)
    grads = {}
    for name, mb, recompute in [("padded", few.micro_batches(None, 1 << 20)[0], "none")] + \
            [(f"packed {r}", few.micro_batches(None, 1 << 20, packed=True)[0], r) for r in RECOMPUTE]:
        small.zero_grad(set_to_none=True)
        with mode("invariant"):
            logp, _ = completion_logprobs(small, mb, 1.0, recompute=recompute)
        (logp * torch.linspace(-1, 1, logp.numel(), device="cuda").view_as(logp)).sum().backward()
        grads[name] = {k: p.grad.float().clone() for k, p in small.named_parameters()}
    small.zero_grad(set_to_none=True)
    for k, g in grads["padded"].items():
        assert (grads["packed none"][k] - g).norm() <= 2e-2 * g.norm() + 1e-6, k
        for r in RECOMPUTE[1:]:
            assert torch.equal(grads[f"packed {r}"][k], grads["packed none"][k]), f"{k} ({r})"

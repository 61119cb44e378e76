"""torchtitan's own model routed through the workbench's kernels on a real GPU, at the SmolLM2-135M (torchtitan's
Llama 3) and Qwen3-1.7B (its Qwen3) shapes with random weights: its training forward scores the workbench
generator's samples with the generator's bits (0 differing tokens), its backward gives the workbench model's
gradients bit for bit, and torchtitan's own forward on the same weights (the control) differs."""

from __future__ import annotations

import pytest
import torch
from helpers import random_gpu_model

from workbench.generation import SamplingParams, generate
from workbench.kernels import mode
from workbench.models import config
from workbench.rl.logprobs import completion_logprobs, parity_stats
from workbench.rl.rollout import RolloutBatch
from workbench.titan.model import build_titan_model, titan_model
from workbench.titan.weights import to_titan

pytestmark = pytest.mark.gpu
pytest.importorskip("torchtitan")   # an extra (`.[titan]`), as the other torchtitan tests

SHAPES = ("smollm2-135M", "qwen3-1.7B")


@pytest.fixture(scope="module", params=SHAPES)
def models(request):
    cfg = config(request.param)
    ours = random_gpu_model(request.param)
    titan = build_titan_model(cfg, "cuda", seed=None)
    titan.load_state_dict(to_titan(ours.state_dict(), cfg))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 64, (6,), generator=g)]
    with mode("invariant"):
        gen = generate(ours, prompts, SamplingParams(temperature=1.0, max_new_tokens=128, seed=3))
    batch = RolloutBatch.from_generation(prompts, gen.completions, 0, "cuda")
    return cfg, ours, titan, batch


def _scored(model, batch: RolloutBatch) -> torch.Tensor:
    """[B, T] log-probs of the batch's tokens from `model`'s training forward (autograd recording)."""
    out = torch.zeros_like(batch.mask)
    for mb in batch.micro_batches(None, 4096):
        lp, _ = completion_logprobs(model, mb, 1.0)
        out[mb.index, : mb.width] = lp.detach()
    return out


def test_training_forward_is_the_generators_bits(models):
    cfg, _, titan, batch = models
    with mode("invariant"):
        stats = parity_stats(batch.behavior, _scored(titan, batch), batch.mask)
    assert stats["tokens"] > 300 and stats["tokens_differing"] == 0, f"{cfg.model_type}: {stats}"


def test_gradients_are_the_workbench_models_bits(models):
    cfg, ours, titan, batch = models
    mb = batch.micro_batches(None, 4096)[0]
    grads = []
    for model in (ours, titan):
        model.zero_grad(set_to_none=True)
        with mode("invariant"):
            lp, _ = completion_logprobs(model, mb, 1.0)
        (lp * torch.linspace(-1, 1, lp.numel(), device="cuda").view_as(lp)).sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    want = to_titan(grads[0], cfg)
    for name, g in grads[1].items():
        assert torch.equal(g, want[name]), name
    ours.zero_grad(set_to_none=True)
    titan.zero_grad(set_to_none=True)


def test_torchtitans_own_forward_differs(models):
    """The negative control: torchtitan's own forward (cuBLAS, SDPA, its RoPE tables) on the same weights."""
    cfg, ours, _, batch = models
    own = titan_model(cfg, "cuda")
    own.load_state_dict(to_titan(ours.state_dict(), cfg))
    with torch.no_grad():
        control = torch.zeros_like(batch.mask)
        for mb in batch.micro_batches(None, 4096):
            logits = own(mb.ids)[mb.rows, mb.positions].float()
            lp = torch.log_softmax(logits, -1).gather(-1, mb.targets[:, None])[:, 0]
            control[mb.index, : mb.width] = torch.zeros(len(mb.index), mb.width, device="cuda").index_put(
                (mb.rows, mb.columns), lp)
    stats = parity_stats(batch.behavior, control, batch.mask)
    assert stats["tokens_differing"] > 0 and stats["max_abs_diff"] < 1.0, stats

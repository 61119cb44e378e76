"""LoRA on a real GPU at the Qwen3-1.7B shape (random weights, r = 16 on all seven projections, random nonzero B):
the embedded generator's sampled tokens and log-probs against the trainer's log-probs of the same tokens, both
running the adapters unmerged, the generator on its own copy synced adapters-only. Invariant mode: bitwise equal;
standard mode (the negative control): they differ."""

from __future__ import annotations

import pytest
import torch
from helpers import random_gpu_model

from workbench.generation import SamplingParams, generate
from workbench.kernels import mode
from workbench.models import RECOMPUTE
from workbench.models.lora import adapter_state
from workbench.rl.config import TrainConfig
from workbench.rl.logprobs import completion_logprobs, parity_stats, score
from workbench.rl.rollout import RolloutBatch
from workbench.rl.sync import WeightSync
from workbench.rl.weights import TrainWeights

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def trainer_and_generator(tmp_path_factory):
    start = random_gpu_model()
    g = torch.Generator(device="cuda").manual_seed(1)
    cfg = TrainConfig(adapter="lora", lora_rank=16, lora_alpha=32.0, sync="copy", device="cuda")
    weights = TrainWeights(start, "float32", 1e-6, "cuda", lora=cfg.optim.lora_config())
    with torch.no_grad():  # B = 0 would make the adapters invisible: the comparison would prove nothing
        for k, m in weights.masters.items():
            if k.endswith("lora_B"):
                m.normal_(0.0, 0.02, generator=g)
    weights.sync_model()
    sync = WeightSync(cfg, weights.model, tmp_path_factory.mktemp("sync"), "cuda")
    sync(0)
    assert sync.moved_bytes == sum(p.numel() * 2 for p in adapter_state(weights.model).values())
    return weights, sync.generator


def _rollouts(generator, kernel_mode: str) -> RolloutBatch:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151936, (int(n),), generator=g).tolist() for n in torch.randint(8, 96, (32,),
                                                                                                  generator=g)]
    with mode(kernel_mode):
        gen = generate(generator, prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=3))
    return RolloutBatch.from_generation(prompts, gen.completions, 0, "cuda")


def test_adapters_change_the_policy(trainer_and_generator):
    weights, _ = trainer_and_generator
    ids = torch.randint(0, 151936, (2, 64), device="cuda")
    lora = weights.model.lora
    with mode("invariant"), torch.no_grad():
        adapted = weights.model(ids)
        for m in weights.model.modules():
            if getattr(m, "lora_A", None) is not None:
                m.lora_scale = 0.0
        base = weights.model(ids)
        for m in weights.model.modules():
            if getattr(m, "lora_A", None) is not None:
                m.lora_scale = lora.scale
    assert (adapted.float() - base.float()).abs().max() > 0.05, "the random B must move the logits"


def test_generator_and_trainer_are_bitwise_with_adapters(trainer_and_generator):
    weights, generator = trainer_and_generator
    batch = _rollouts(generator, "invariant")
    with mode("invariant"):
        trainer, _ = score(weights.model, batch, 16384, 1.0)
        mb = batch.micro_batches(None, 16384)[0]
        logp, _ = completion_logprobs(weights.model, mb, 1.0)  # the update's forward, autograd recording
    stats = parity_stats(batch.behavior, trainer, batch.mask)
    assert stats["tokens"] > 1000 and stats["tokens_differing"] == 0, stats
    assert torch.equal(logp.detach(), trainer[mb.index, : mb.width]), "the update's forward gives the same bits"


def test_adapter_gradients_are_the_same_bits_whatever_the_recompute(trainer_and_generator):
    """The trainer's own path: the adapters' fp32 master gradients, accumulated inside the backward's kernels."""
    weights, generator = trainer_and_generator
    mb = _rollouts(generator, "invariant").micro_batches(None, 16384)[0]
    grads = {}
    for recompute in RECOMPUTE:
        weights.zero_grad()
        with mode("invariant"):
            logp, _ = completion_logprobs(weights.model, mb, 1.0, recompute=recompute)
        (logp * torch.linspace(-1, 1, logp.numel(), device="cuda").view_as(logp)).sum().backward()
        grads[recompute] = {k: m.grad.clone() for k, m in weights.masters.items()}
    weights.zero_grad()
    assert len(grads["none"]) == 28 * 7 * 2 and all(g.abs().sum() > 0 for g in grads["none"].values())
    for recompute in RECOMPUTE[1:]:
        for k, g in grads["none"].items():
            assert torch.equal(g, grads[recompute][k]), f"{k} ({recompute})"


def test_standard_mode_differs(trainer_and_generator):
    weights, generator = trainer_and_generator
    batch = _rollouts(generator, "standard")
    with mode("standard"):
        trainer, _ = score(weights.model, batch, 16384, 1.0)
    stats = parity_stats(batch.behavior, trainer, batch.mask)
    assert stats["tokens_differing"] > 0, "the standard control must show the mismatch LoRA does not remove"
    assert stats["max_abs_diff"] < 1.0, stats


def test_gpu_lora_add_is_the_formula_bitwise():
    """fp32 multiply, fp32 add, one RNE cast: no FMA contraction (an FMA rounds once and changes some bits). The
    scale is not a power of two, so the product is rounded and the two formulas do differ somewhere."""
    from workbench.kernels import lora_add

    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(4096, 6144, device="cuda", generator=g).bfloat16()
    low = (torch.randn(4096, 6144, device="cuda", generator=g) * 0.1).bfloat16()
    scale = 32.0 / 12
    with mode("invariant"):
        y = lora_add(base, low, scale)
    p = low.float() * scale
    assert torch.equal(y, (p + base.float()).bfloat16())
    fma = torch.addcmul(base.double(), low.double(), torch.tensor(scale, dtype=torch.float32).double())
    assert not torch.equal(y, fma.float().bfloat16()), "the control: one rounding gives other bits somewhere"

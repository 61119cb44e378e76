"""The torchtitan trainer backend on a real GPU at the SmolLM2-135M (Llama 3 layout, untied) and Qwen3-1.7B (tied)
shapes, random weights: the titan model's log-probs of the workbench generator's samples are the sampled bits
(0 differing tokens) before and after each update, and two clipped GRPO updates give the workbench trainer's masters
and generator weights bit for bit (both on right-padded micro-batches)."""

from __future__ import annotations

import pytest
import torch
from helpers import random_gpu_model, same_bits

pytestmark = pytest.mark.gpu
pytest.importorskip("torchtitan")

DEVICE, PROMPT_MAX, MAX_NEW = "cuda", 48, 64
"""Where and how long: 16 prompts of 4..47 tokens, up to 64 sampled tokens each."""


def _rollout(model, seed: int):
    from workbench.generation import SamplingParams, generate
    from workbench.rl.rollout import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(4, PROMPT_MAX, (16,), generator=g)]
    out = generate(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=seed))
    return RolloutBatch.from_generation(prompts, out.completions, 0, DEVICE)


@pytest.mark.parametrize("shape", ["smollm2-135M", pytest.param("qwen3-1.7B", marks=pytest.mark.slow)])  # 21 s
def test_titan_backend_parity_and_the_workbench_update(shape):
    from workbench.kernels import mode
    from workbench.rl.config import TrainConfig
    from workbench.rl.logprobs import parity_stats, score
    from workbench.rl.losses import get_loss
    from workbench.rl.update import UpdateInputs, update
    from workbench.rl.weights import TrainWeights
    from workbench.rl.titan_backend import TitanWeights
    from workbench.titan.weights import from_titan

    # Right-padded micro-batches on both sides: torchtitan's routed model has no packed form, and packing sums the
    # weight gradients in another grouping.
    cfg = TrainConfig(lr=1e-5, max_grad_norm=0.1, weight_decay=0.01, mini_batches=2, group_size=4,
                      prompts_per_step=4, max_new_tokens=MAX_NEW, trainer_backend="torchtitan", packed_sequences=False)
    ends, norms = {}, {}
    for backend in ("workbench", "torchtitan"):
        start = random_gpu_model(shape, seed=1).float()
        w = TitanWeights(start, cfg, DEVICE) if backend == "torchtitan" else \
            TrainWeights(start, "float32", cfg.optim.lr, DEVICE, cfg.optim.weight_decay, cfg.optim.max_grad_norm)
        del start
        norms[backend] = []
        with mode("invariant"):
            for step in (1, 2):
                batch = _rollout(w.model, seed=step)
                old, _ = score(w.scorer, batch, cfg.optim.max_tokens_per_microbatch, 1.0)
                parity = parity_stats(batch.behavior, old, batch.mask)
                assert parity["tokens_differing"] == 0, f"{backend} step {step}: {parity}"
                adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(step)).to(DEVICE)
                out = update(cfg, get_loss("grpo"), w, batch, UpdateInputs(adv, old, None, None), step,
                             lambda loss: pytest.fail(f"loss {loss}"))
                norms[backend].append(out["grad_norm"])
        masters = {k: v.detach().cpu() for k, v in w.masters.items()}
        ends[backend] = (from_titan(masters, w.model.config) if backend == "torchtitan" else masters,
                         {k: v.cpu() for k, v in w.model.state_dict().items()})
        del w
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    assert min(norms["workbench"]) > cfg.optim.max_grad_norm, "the clipping must be active"
    assert norms["torchtitan"] == norms["workbench"]
    assert same_bits(ends["torchtitan"], ends["workbench"])

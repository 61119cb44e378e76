"""The real SmolLM2-135M-Instruct on the GPU (skipped without CUDA; the `smollm2` fixture fetches it once):
the generator/trainer triangle bitwise on 64 ragged chat prompts x 128 sampled tokens, the standard kernels'
mismatch as the negative control, and the logits against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from workbench.generation import SamplingParams
from workbench.generation.parity import parity_triangle
from workbench.kernels import mode
from workbench.models import encode_prompt, load_pretrained, load_tokenizer
from workbench.tasks import make_task

pytestmark = pytest.mark.gpu


def _prompts(tok, n: int) -> list[list[int]]:
    """Chat-formatted arithmetic questions of several lengths (difficulties 1-4): a ragged batch."""
    out = []
    for d in range(1, 5):
        task = make_task("arithmetic", seed=d, difficulty=d)
        out += [encode_prompt(tok, f"What is {p.prompt.rstrip('=')}? Think step by step.")
                for p in task.problems(n // 4)]
    return out


@pytest.fixture(scope="module")
def real(smollm2):
    return load_pretrained(smollm2, device="cuda"), load_tokenizer(smollm2)


def test_gpu_real_model_triangle_bitwise_and_standard_differs(real):
    model, tok = real
    prompts = _prompts(tok, 64)
    assert len({len(p) for p in prompts}) > 4, "the batch should be ragged"
    params = SamplingParams(temperature=1.0, max_new_tokens=128, seed=0)
    with mode("invariant"):
        tokens, pairs = parity_triangle(model, prompts, params)
    assert len(tokens) == 64 * 128
    assert pairs.tokens_differing.sum() == 0, pairs.to_string()
    with mode("standard"):
        _, off = parity_triangle(model, prompts, params)
    decode_vs_train = off.set_index("pair").loc["decode vs train"]
    print(off.to_string())
    assert decode_vs_train.tokens_differing > 0, "standard kernels matched bitwise: the control shows nothing"


def test_gpu_real_model_logits_match_transformers(smollm2, real):
    """Top-1 tokens over 8 chat prompts (the shared system turn counted once): the workbench's bf16 (invariant
    kernels) against transformers' bf16 and against transformers' fp32, the model both approximate. bf16
    rounding alone flips some near-ties, so ours must be as close to fp32 as transformers' bf16 is."""
    transformers = pytest.importorskip("transformers")
    model, tok = real
    prompts = _prompts(tok, 8)
    t = min(map(len, prompts))
    ids = torch.tensor([p[:t] for p in prompts], device="cuda")
    shared = int((ids == ids[:1]).all(0).int().cumprod(0).sum())
    keep = torch.ones(ids.shape, dtype=torch.bool, device="cuda")
    keep[1:, :shared] = False
    with torch.no_grad():
        top = {dtype: transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype).cuda().eval()(ids)
               .logits.argmax(-1) for dtype in (torch.float32, torch.bfloat16)}
        with mode("invariant"):
            ours = model(ids).argmax(-1)
    rate = lambda a, b: ((a == b) & keep).sum().item() / keep.sum().item()  # noqa: E731
    ours_ref, ours_true, ref_true = rate(ours, top[torch.bfloat16]), rate(ours, top[torch.float32]), \
        rate(top[torch.bfloat16], top[torch.float32])
    print(f"top-1 over {int(keep.sum())} positions: ours = transformers bf16 {ours_ref:.2%}, ours = fp32 "
          f"{ours_true:.2%}, transformers bf16 = fp32 {ref_true:.2%}")
    assert ours_true >= ref_true - 0.01 and ours_ref >= 0.95


@pytest.mark.slow
def test_gpu_warm_start_gives_the_same_bits_twice_and_other_bits_for_another_seed(smollm2, tmp_path):
    """Each GPU hold warm-starts its own starting policy, and the regime map pairs arms only from the same weights'
    digest: two warm starts with one config must save the same bits (deterministic algorithms), a third with another
    seed other bits (the digest can tell them apart)."""
    import dataclasses

    from safetensors.torch import load_file

    from workbench.models.checkpoint import weights_checksum
    from workbench.policies.warmstart import WarmStartConfig, warm_start

    cfg = WarmStartConfig(policy=smollm2, max_new_tokens=64, steps=4, batch_size=8, eval_every=2, eval_problems=8,
                          target_reward=(0.99, 1.0), device="cuda")
    digests = []
    for name, c in (("a", cfg), ("b", cfg), ("other", dataclasses.replace(cfg, seed=cfg.seed + 1))):
        warm_start(c, tmp_path / name)
        digests.append(weights_checksum(load_file(str(tmp_path / name / "model.safetensors"))))
    assert digests[0] == digests[1], "one config, two warm starts: other bits"
    assert digests[2] != digests[0], "another seed gave the same bits: the digest tells nothing apart"

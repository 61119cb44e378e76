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
from workbench.rl.tasks import make_task

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
    transformers = pytest.importorskip("transformers")
    model, tok = real
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([p[:48] for p in _prompts(tok, 8) if len(p) >= 48][:4], device="cuda")
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = model(ids).float()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert top1 >= 0.99, f"bf16 top-1 agreement {top1:.3f}"

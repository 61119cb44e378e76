"""Run-to-run bits of the trainer's forward and backward and of the engine's sampler, per kernel mode.

Why: an `off` run of the regime map did not repeat its own earlier copy bit for bit from its first update on, while
`on` runs did (`2026-12-03_onoff-regime-arm-off-L256-blog-s0-3-h200_10ee809`). This repeats each mode's pieces in
one process and prints a digest a repetition; two processes' digests compare across processes. Last, the trainer's
packed attention alone at the RL update's lengths, with torch's deterministic algorithms off and on.

    python bench/probe_repro.py [shape]    # default smollm2-135M, random weights; 'tiny' runs on a CPU
"""

from __future__ import annotations

import sys

import torch

from bench_generate import _prompts
from timing import MODES          # the trainer's modes and the engine's (`standard-fused`: `rl.samplers`)

from workbench.generation import SamplingParams, generate
from workbench.kernels.attention_varlen import attention_varlen
from workbench.kernels.mode import mode
from workbench.models import build
from workbench.models.checkpoint import weights_checksum


def digest(tensors) -> str:
    """The first 12 hex digits of the tensors' bytes' sha256 (`weights_checksum`)."""
    return weights_checksum({f"{i:04d}": t for i, t in enumerate(tensors)})[:12]


def varlen_attention(dev: str, small: bool) -> None:
    """The trainer's packed attention, forward and backward, four times a mode (torch's deterministic algorithms
    off, then on). FlashAttention-2's backward adds each key block's share of dQ atomically: the order of two
    shares does not change their sum, so the sequences are long enough for several key blocks (the RL update's
    packed prompts and answers, 256-1,024 new tokens)."""
    g = torch.Generator().manual_seed(0)
    lens = [5, 9, 3] if small else [450, 1210, 330, 790, 1100, 610]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    # The 135M shape's heads: 9 query heads over 3 key/value heads, 64 wide.
    q, k, v, dy = (torch.randn(sum(lens), heads, 64, generator=g).to(dev, torch.bfloat16) for heads in (9, 3, 3, 9))
    for name, deterministic in (("standard", False), ("standard", True), ("invariant", False)):
        torch.use_deterministic_algorithms(deterministic)
        runs = []
        for _ in range(4):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            with mode(name):
                out = attention_varlen(*leaves, cu, max(lens))
            out.backward(dy)
            runs.append(f"{digest([out])}/{digest(t.grad for t in leaves)}")
        torch.use_deterministic_algorithms(False)
        print(f"packed attention, {name}, deterministic algorithms {'on' if deterministic else 'off'}: "
              f"out/grads {runs}", flush=True)


def main(shape: str = "smollm2-135M") -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    small = dev == "cpu"
    model = build(shape, device=dev, dtype=torch.bfloat16, seed=0)
    vocab = model.config.vocab_size
    ids = torch.tensor(_prompts(2 if small else 16, vocab, 16 if small else 256), device=dev)
    prompts = _prompts(2 if small else 64, vocab, 8 if small else 128)
    params = SamplingParams(max_new_tokens=4 if small else 128, seed=1)
    for name, (default, overrides) in MODES.items():
        train = []
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            with mode(default, **overrides):
                logits = model(ids).float()
                torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum().backward()
            train.append(f"{digest([logits])}/{digest(p.grad for p in model.parameters())}")
        sampled = []
        for _ in range(3):
            with mode(default, **overrides):
                out = generate(model, prompts, params)
            sampled.append(digest([torch.tensor(sum((c.tokens for c in out.completions), []))]
                                  + [c.logprobs for c in out.completions]))
        print(f"{name}: train logits/grads {train}; generate tokens+log-probs {sampled}", flush=True)
    varlen_attention(dev, small)


if __name__ == "__main__":
    main(*sys.argv[1:2])

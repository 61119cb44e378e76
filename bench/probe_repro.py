"""Run-to-run bits of the trainer's forward and backward and of the engine's sampler, per kernel mode.

Why: an `off` run of the regime map did not repeat its own earlier copy bit for bit from its first update on, while
`on` runs did (`2026-12-03_onoff-regime-arm-off-L256-blog-s0-3-h200_10ee809`). This repeats each mode's pieces in
one process and prints a digest a repetition; two processes' digests compare across processes.

    python bench/probe_repro.py [shape]    # default smollm2-135M, random weights; 'tiny' runs on a CPU
"""

from __future__ import annotations

import hashlib
import sys

import torch

from bench_generate import _prompts
from workbench.generation import SamplingParams, generate
from workbench.kernels.mode import FUSED_ROWWISE, mode
from workbench.models import build

MODES = {"invariant": ("invariant", {}), "standard": ("standard", {}), "standard-fused": ("standard", FUSED_ROWWISE)}
"""The trainer's modes and the engine's (`standard` with the fused row-wise ops: `rl.samplers`)."""


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


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


if __name__ == "__main__":
    main(*sys.argv[1:2])

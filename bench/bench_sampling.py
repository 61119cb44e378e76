"""The sampler's draw: the fused Gumbel-max kernel against the PyTorch form it replaced, alone and
inside the embedded generator (Qwen3-1.7B shape, random weights, 128-token prompts, 256 new tokens).

    python bench/bench_sampling.py --out runs/bench_sampling.md
"""

from __future__ import annotations

import argparse
import time

from timing import emit, gpu_ms, header

import torch

import workbench.generation.sampling as sampling
from workbench.generation import SamplingParams, generate
from workbench.kernels import gumbel_argmax, mode
from workbench.kernels.gumbel import gumbel_argmax_reference
from workbench.models import build

VOCAB = 151936


def _torch_draw(logits, temperature, seed, request_ids, positions, keep=None):
    return gumbel_argmax_reference(logits, temperature, sampling.uniforms(seed, request_ids, positions,
                                                                          logits.shape[-1]), keep)


def _draw_ms(fn, batch):
    def make():
        logits = torch.randn(batch, VOCAB, device="cuda").bfloat16()
        req, pos = torch.arange(batch, device="cuda"), torch.full((batch,), 200, device="cuda")
        return lambda: fn(logits, 1.0, 3, req, pos)
    return gpu_ms(make, batch * VOCAB * 2)


def _generate_tok_s(model, batch):
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, VOCAB, (batch, 128), generator=g).tolist()
    with mode("invariant"):
        generate(model, prompts, SamplingParams(max_new_tokens=4))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompts, SamplingParams(max_new_tokens=256, seed=1))
        torch.cuda.synchronize()
    return out.new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    a = p.parse_args()
    model = build("qwen3-1.7B", device="cuda", seed=0)
    lines = [header(), "", "| batch | draw ms, fused | draw ms, PyTorch | speed-up | generate tok/s, fused | "
             "generate tok/s, PyTorch draw | ratio |", "|---|---|---|---|---|---|---|"]
    for batch in (64, 256):
        fused, torch_ms = _draw_ms(gumbel_argmax, batch), _draw_ms(_torch_draw, batch)
        with_fused = _generate_tok_s(model, batch)
        sampling.gumbel_argmax = _torch_draw
        try:
            with_torch = _generate_tok_s(model, batch)
        finally:
            sampling.gumbel_argmax = gumbel_argmax
        lines.append(f"| {batch} | {fused:.3f} | {torch_ms:.3f} | {torch_ms / fused:.1f}x | {with_fused:,.0f} | "
                     f"{with_torch:,.0f} | {with_fused / with_torch:.2f}x |")
        print("\n".join(lines), flush=True)
    emit(lines, a.out)


if __name__ == "__main__":
    main()

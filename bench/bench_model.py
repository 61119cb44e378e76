"""GPU benchmark of the model on the kernel library, against the standard path in the same run.

- Training forward + backward (a log-prob loss over every token), Qwen3-1.7B
  shape with random weights, batch 8 x 1024 tokens: tokens/s in invariant and
  standard mode.
- The attention kernel's forward and forward + backward against PyTorch SDPA
  (flash), 16 query / 8 KV heads of 128, batch 8, causal, sequence 1024-4096.

    python bench/bench_model.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from timing import emit, gpu_ms, header

from workbench.kernels import REGISTRY, mode, token_logprobs
from workbench.models import build


def train_step_ms(model, ids, reps: int = 5) -> float:
    """Median wall time of one forward + backward (events around the whole step, Python included)."""
    def step():
        logits = model(ids[:, :-1])
        loss = -token_logprobs(logits, ids[:, 1:]).mean()
        loss.backward()

    for _ in range(2):
        step()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def attention_rows():
    inv = REGISTRY["attention"].invariant
    rows = []
    for t in (1024, 2048, 4096):
        nbytes = 2 * 8 * t * (16 + 8 + 8 + 16) * 128

        def make(fn, grad):
            def call():
                q = torch.randn(8, t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                k = torch.randn(8, t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                v = torch.randn(8, t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                if not grad:
                    return lambda: fn(q, k, v)
                g = torch.randn(8, t, 16, 128, device="cuda", dtype=torch.bfloat16)
                return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), g)
            return call

        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)

        for label, grad in (("fwd", False), ("fwd+bwd", True)):
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                t_std = gpu_ms(make(sdpa, grad), nbytes)
            rows.append((label, t, gpu_ms(make(inv, grad), nbytes), t_std))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_model.py needs a CUDA GPU")
    lines = [header(), ""]
    model = build("qwen3-1.7B", device="cuda", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (8, 1025), device="cuda")
    tokens = ids[:, :-1].numel()
    ms = {}
    for m in ("invariant", "standard"):
        with mode(m):
            ms[m] = train_step_ms(model, ids)
    lines += ["| Qwen3-1.7B shape, train fwd+bwd, 8 x 1024 | invariant | standard | ratio |", "|---|---|---|---|",
              f"| tokens/s | {tokens / ms['invariant'] * 1e3:,.0f} | {tokens / ms['standard'] * 1e3:,.0f} | "
              f"{ms['standard'] / ms['invariant']:.2f} |",
              f"| ms per step | {ms['invariant']:.1f} | {ms['standard']:.1f} | |", ""]
    del model
    torch.cuda.empty_cache()
    lines += ["| attention (B 8, Hq 16, Hkv 8, D 128, causal) | T | invariant ms | SDPA flash ms | SDPA / invariant |",
              "|---|---|---|---|---|"]
    for label, t, ti, ts in attention_rows():
        lines.append(f"| {label} | {t} | {ti:.3f} | {ts:.3f} | {ts / ti:.2f} |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()

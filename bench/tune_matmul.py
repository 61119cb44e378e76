"""Offline tuning of the invariant matmul's tile buckets (GPU only).

For each candidate config: (1) does it give the same bits as the reference
config on every row (a bucket may only be used if it does), (2) its time
against cuBLAS on the Qwen3-1.7B projection shapes. The chosen table is then
written into `workbench/kernels/matmul.py` by hand: nothing is tuned at run time.

    python bench/tune_matmul.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton

from workbench.kernels import matmul as mm

SHAPES = [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048), (2048, 151936)]
MS = [1, 8, 32, 128, 512, 2048, 8192]
CANDIDATES = [
    mm.MatmulConfig(256, 128, 64, 8, 8, 3),  # reference: the current large-M bucket
    mm.MatmulConfig(16, 64, 64, 8, 4, 4),
    mm.MatmulConfig(16, 32, 64, 8, 4, 4),
    mm.MatmulConfig(16, 32, 64, 8, 2, 6),
    mm.MatmulConfig(16, 64, 64, 8, 4, 6),
    mm.MatmulConfig(32, 32, 64, 8, 4, 5),
    mm.MatmulConfig(64, 32, 64, 8, 4, 4),
    mm.MatmulConfig(64, 128, 64, 8, 4, 4),
    mm.MatmulConfig(128, 128, 64, 8, 8, 4),
    mm.MatmulConfig(256, 128, 64, 8, 8, 4),
    mm.MatmulConfig(256, 128, 64, 16, 8, 3),
    mm.MatmulConfig(16, 64, 128, 8, 4, 4),
    mm.MatmulConfig(256, 128, 128, 8, 8, 2),
]


def run_with(cfg, a, b):
    saved = mm.MATMUL_BUCKETS
    mm.MATMUL_BUCKETS = ((1 << 62, cfg),)
    try:
        return mm.matmul(a, b)
    finally:
        mm.MATMUL_BUCKETS = saved


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    # 1. bitwise agreement of every candidate with the first 128x256 one.
    k, n = 2048, 4096
    x = torch.randn(300, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    ref = run_with(CANDIDATES[0], x, w.t())
    print("bitwise vs the first candidate:")
    for cfg in CANDIDATES:
        out = run_with(cfg, x, w.t())
        one = run_with(cfg, x[5:6], w.t())
        print(f"  {cfg}: equal={torch.equal(out, ref)} maxdiff={(out.float()-ref.float()).abs().max().item():.3g}"
              f" row5_alone_equal={torch.equal(one, ref[5:6])}")
    # 2. timings.
    print(f"{'K':>5} {'N':>7} {'M':>5} {'cublas_us':>9} " + " ".join(f"c{i}" for i in range(len(CANDIDATES))))
    for (k, n), m in itertools.product(SHAPES, MS):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        t_ref = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=40, return_mode="median")
        ratios = []
        for cfg in CANDIDATES:
            t = triton.testing.do_bench(lambda: run_with(cfg, x, w.t()), warmup=10, rep=40, return_mode="median")
            ratios.append(t_ref / t)
        print(f"{k:>5} {n:>7} {m:>5} {t_ref*1e3:9.1f} " + " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()

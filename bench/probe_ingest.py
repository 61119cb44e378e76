"""What bounds a decode product's activation reads: the L2's shared output, or each SM's own intake?

At 64 rows every program of a decode product reads the whole [64, K] activation from the L2 (BENCHMARKS,
"The persistent decode kernel ... measured"). If those reads are bound by the L2's output, shared by all SMs,
a cluster's TMA multicast (one L2 read delivered to several SMs) would shorten them. If they are bound by each
SM's own intake, every SM still takes in every byte it uses, multicast or not, and no way of sharing the reads
can make a product faster than its least bytes an SM over that intake rate.

The measurement: P programs (one an SM while P is at most the SM count: the block scheduler spreads them)
each stream the same 64 rows x K of x through TMA, S stages of 64 x BLOCK_K, into a dot against one 16-wide
weight tile, as a product's consumer would. P runs from 1 to the SM count. With an L2 bound the rate an SM falls
as P grows; with an intake bound it stays. The same with an empty loop (K = 0) gives the launch's own time, which
the "streaming" columns leave out. 20 launches in a CUDA graph, the median of 20 replays. Then 1, 2 or 3
programs an SM: whether one program's rate is its own pipeline's or the SM's ceiling.

Then the arithmetic it bounds (no GPU): at batch 64 and 256, each Qwen3-1.7B decode product's least bytes an SM
when every output keeps its whole K chain on one SM (the bits contract: no split K), i.e. an SM's outputs in an
R x C block, bytes (R + C) x K x 2 with R <= M; the time of those bytes at the steady intake rate measured above
against the time of the weights at the measured copy bandwidth.

    python bench/probe_ingest.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
from timing import copy_gbs, emit, graph_ms, header  # noqa: E402

ROWS = 64
"""The activation rows a program streams: one decode product's batch-64 tile."""
STAGINGS = ((128, 2), (128, 4), (128, 8), (256, 4))
"""(BLOCK_K, stages): 32 to 128 KB in flight an SM."""
DEPTHS = (2048, 6144, 65536)
"""K: the decode products' depths (hidden, intermediate) and a long one (the steady rate)."""
QWEN3_1P7B = {"q+k+v": (4096, 2048, 28), "o": (2048, 2048, 28), "gate+up": (12288, 2048, 28),
              "down": (2048, 6144, 28), "LM head": (151936, 2048, 1)}
"""Each decode product's (N, K, times a step)."""


@triton.jit
def _ingest_kernel(x_desc, w_ptr, out_ptr, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # Every program reads the same rows 0 .. BLOCK_M of x, as every program of a batch-64 decode product does.
    pid = tl.program_id(0)
    cols = tl.arange(0, 16)
    w = tl.load(w_ptr + tl.arange(0, BLOCK_K)[:, None] * 16 + cols[None, :])
    acc = tl.zeros((BLOCK_M, 16), tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(x_desc.load([0, k]), w, acc)
    rows = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + pid * BLOCK_M * 16 + rows[:, None] * 16 + cols[None, :], acc)


def _stream(p: int, k: int, desc, w, out, block_k: int, stages: int) -> tuple[float, float, float]:
    """(us a launch, the empty loop's us, streaming GB/s a program) of p programs each reading the same rows."""
    def launch(depth):
        return lambda: _ingest_kernel[(p,)](desc, w, out, depth, BLOCK_M=ROWS, BLOCK_K=block_k, num_warps=4,
                                            num_stages=stages)
    # 20 launches of the same call: every program reads rows that are in the L2 after the first.
    us, empty = (graph_ms([launch(depth)] * 20) * 1e3 for depth in (k, 0))
    return us, empty, ROWS * k * 2 / 1e3 / max(us - empty, 1e-3)


def intake(sms: int) -> tuple[list[str], float]:
    """The streaming table, and the steady rate an SM (GB/s) with every SM reading: the best staging at the
    longest K and P = sms."""
    grid = sorted({1, 8, 16, sms // 4, sms // 2, sms})
    lines = ["", f"Activation reads alone: P programs each stream the same {ROWS} rows x K through TMA ({sms} SMs). "
             "us a launch; the streaming columns leave out the empty loop's time at the same P and staging.", "",
             "| BLOCK_K x stages | K | P | KB a program | us a launch | empty loop us | streaming GB/s an SM | "
             "streaming TB/s in all |", "|---|---|---|---|---|---|---|---|"]
    steady = 0.0
    for block_k, stages in STAGINGS:
        w = torch.randn(block_k, 16, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(sms, ROWS, 16, device="cuda", dtype=torch.float32)
        for k in DEPTHS:
            x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
            desc = TensorDescriptor.from_tensor(x, [ROWS, block_k])
            for p in grid:
                us, empty, rate = _stream(p, k, desc, w, out, block_k, stages)
                kb = ROWS * k * 2 / 1024
                if k == DEPTHS[-1] and p == sms:
                    steady = max(steady, rate)
                lines.append(f"| {block_k} x {stages} | {k:,} | {p} | {kb:,.0f} | {us:.2f} | {empty:.2f} | "
                             f"{rate:.0f} | {rate * p / 1e3:.2f} |")
                print(lines[-1], flush=True)
    return lines, steady


def per_sm(sms: int) -> list[str]:
    """An SM's own ceiling: 1, 2 or 3 programs an SM (P = 1, 2 or 3 x the SMs), each streaming the same rows. If
    one program's rate is its pipeline's (the bytes it keeps in flight, its cost per stage), two on an SM take in
    more; if it is the SM's intake, they share it."""
    lines = ["", "Several programs an SM, the same streams. GB/s a program and an SM (streaming only):", "",
             "| BLOCK_K x stages | K | P | programs an SM | us a launch | empty loop us | GB/s a program "
             "| GB/s an SM |",
             "|---|---|---|---|---|---|---|---|"]
    for block_k, stages in ((128, 2), (128, 4), (256, 2)):
        w = torch.randn(block_k, 16, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(3 * sms, ROWS, 16, device="cuda", dtype=torch.float32)
        for k in DEPTHS[1:]:
            x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
            desc = TensorDescriptor.from_tensor(x, [ROWS, block_k])
            for per in (1, 2, 3):
                us, empty, rate = _stream(per * sms, k, desc, w, out, block_k, stages)
                lines.append(f"| {block_k} x {stages} | {k:,} | {per * sms} | {per} | {us:.2f} | {empty:.2f} | "
                             f"{rate:.0f} | {rate * per:.0f} |")
                print(lines[-1], flush=True)
    return lines


def least_bytes(m: int, n: int, k: int, sms: int) -> float:
    """The least bytes an SM takes in for an [m, n] product of depth k whose every output keeps its whole K
    chain on one SM: its m * n / sms outputs as an R x C block (R <= m), (R + C) * k * 2 bytes."""
    outputs = m * n / sms
    r = min(math.sqrt(outputs), m)
    return (r + outputs / r) * k * 2


def bound_table(sms: int, rate_gbs: float, copy: float) -> list[str]:
    """Per product: the weights' floor against the least intake an SM at the steady rate."""
    lines = ["", f"The intake bound of each decode product ({sms} SMs, steady intake {rate_gbs:.0f} GB/s an SM; "
             f"weights at the copy's {copy:,.0f} GB/s). us a step, all layers:", "",
             "| batch | product | weights' floor us | least KB an SM | intake us | the larger |",
             "|---|---|---|---|---|---|"]
    for m in (64, 256):
        floor_sum = bound_sum = 0.0
        for name, (n, k, times) in QWEN3_1P7B.items():
            weights = n * k * 2 / copy / 1e3 * times
            kb = least_bytes(m, n, k, sms) / 1024
            taken = kb * 1.024 / rate_gbs * times
            floor_sum += weights
            bound_sum += max(weights, taken)
            lines.append(f"| {m} | {name} | {weights:,.0f} | {kb:,.0f} | {taken:,.0f} | {max(weights, taken):,.0f} |")
        lines.append(f"| {m} | **all** | **{floor_sum:,.0f}** | | | "
                     f"**{bound_sum:,.0f}** ({bound_sum / floor_sum:.2f}x) |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_ingest.py needs a CUDA GPU (it measures an SM's intake); run it on the device")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy = copy_gbs()[0]
    lines = [header(), f"Copy bandwidth (read + write): {copy:,.0f} GB/s."]
    table, steady = intake(sms)
    emit(lines + table + per_sm(sms) + bound_table(sms, steady, copy), args.out)


if __name__ == "__main__":
    main()

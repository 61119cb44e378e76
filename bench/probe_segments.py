"""Issue 44, target 1's next idea, measured before anything is built: K cut into S fixed segments, each accumulated
from zero in its own fp32 chain, the S partials added in segment order (total = ((0 + p0) + p1) + ...). A decode
product may then run a tile's segments in parallel, one program each, the tile's last program adding the stored
partials in order (split-K with an in-order fix-up); the training product must give the same bits, so it runs the
same segments one after another in one program with a second accumulator. Both forms are written here, outside the
package, only to be timed:

1. the bits: the decode form at 1, 64 and 256 rows against the training form's rows at 16,384, bitwise, for S = 1,
   2, 4, and each against today's `matmul` (S = 1 should be today's bits; S > 1 is a new contract);
2. the decode products of the Qwen3-1.7B shape at batch 64 and 256 (q+k+v, o, gate+up, down): today's kernel
   under PDL against the parallel segments (S = 1, 2, 4; 64 or 128 columns a tile), each in a CUDA graph of calls
   on fresh weights (`timing.gpu_ms`), beside the bandwidth floor (weight bytes / measured copy bandwidth);
3. the same products' forward at 16,384 rows (a training micro-batch): today's kernel against the segmented one
   (S = 1, 2, 4; 128 x 256 and 128 x 128 tiles, persistent), in TFLOP/s.

The question it answers: does the decode gain exceed what the training products lose? (BENCHMARKS.md, "The
decode step at 1.3x its floor".) H100 or H200; the decode forms use pointer loads, the training forms TMA.

    python bench/probe_segments.py [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from timing import copy_gbs, emit, gpu_ms, header  # noqa: E402

from workbench.kernels import matmul as mm  # noqa: E402
from workbench.kernels.runtime import pdl, pdl_enter, pdl_flags  # noqa: E402
from workbench.kernels.runtime import interpreting  # noqa: E402
from workbench.kernels.matmul import _tile_origin, dot_step  # noqa: E402

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate+up": (12288, 2048), "down": (2048, 6144)}
"""Qwen3-1.7B's decoder products, (N, K)."""
BLOCK_K = 128
"""Both forms' K block (on Hopper the chain of k16 MMA steps does not depend on it)."""


@triton.jit
def _decode_kernel(a_ptr, b_ptr, c_ptr, part_ptr, count_ptr, M, N, K, SEG_K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEGMENTS: tl.constexpr,
                   DOT_IN_FP32: tl.constexpr, PDL: tl.constexpr):
    # C[M, N] = A[M, K] @ B[N, K]^T; program (tile, s) takes segment s of K. Its fp32 partial goes to
    # part[s]; the tile's last program to arrive (acq_rel counter) adds part[0..S-1] in order to 0 and stores.
    pdl_enter(PDL)
    tile = tl.program_id(0)
    s = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tile // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = s * SEG_K + tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * K + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * K + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, SEG_K // BLOCK_K):
        acc = dot_step(tl.load(a_ptrs), tl.load(b_ptrs), acc, DOT_IN_FP32, DOT_IN_FP32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if SEGMENTS == 1:
        tl.store(c_ptr + out, (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + acc).to(tl.bfloat16), mask=mask)
    else:
        tl.store(part_ptr + s.to(tl.int64) * M * N + out, acc, mask=mask)
        tl.debug_barrier()   # every thread's stores issued before the release below publishes them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SEGMENTS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t in tl.static_range(SEGMENTS):
                total += tl.load(part_ptr + t * M * N + out, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(c_ptr + out, total.to(tl.bfloat16), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")   # ready for the next launch (graph replays)


def decode(a: torch.Tensor, w: torch.Tensor, segments: int, block_n: int) -> tuple:
    """(call, output) of the decode form for a [M, K] and a weight [N, K], bf16, with its own buffers."""
    m, k = a.shape
    n = w.shape[0]
    block_m = 64 if m >= 64 else 16
    c = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    part = torch.empty(max(segments, 1), m, n, device=a.device, dtype=torch.float32)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    count = torch.zeros(tiles, device=a.device, dtype=torch.int32)

    def call():
        _decode_kernel[(tiles, segments)](a, w, c, part, count, m, n, k, k // segments, BLOCK_M=block_m,
                                          BLOCK_N=block_n, BLOCK_K=BLOCK_K, SEGMENTS=segments, DOT_IN_FP32=interpreting(),
                                          **pdl_flags(a),
                                          num_warps=4, num_stages=4)
        return c
    return call, c


@triton.jit
def _train_kernel(a_desc, b_desc, c_desc, M, N, K, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEGMENTS: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    # The same segments one after another in one program: acc from 0 over segment s, then total += acc.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    seg_blocks = tl.cdiv(K, BLOCK_K) // SEGMENTS
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SEGMENTS):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, seg_blocks):
                off_k = (s * seg_blocks + kb) * BLOCK_K
                acc = dot_step(a_desc.load([off_m, off_k]), tl.trans(b_desc.load([off_n, off_k])), acc, DOT_IN_FP32,
                               DOT_IN_FP32)
            total += acc
        c_desc.store([off_m, off_n], total.to(c_desc.dtype))


def train(a: torch.Tensor, w: torch.Tensor, segments: int, block_n: int) -> tuple:
    """(call, output) of the training form, persistent (one program an SM), 128 x block_n tiles."""
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    block_m, block_k = 128, 64
    descs = (mm._descriptor(a, [block_m, block_k]), mm._descriptor(w, [block_n, block_k]),
             mm._descriptor(c, [block_m, block_n]))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = tiles if interpreting() else min(torch.cuda.get_device_properties(a.device).multi_processor_count,
                                                tiles)

    def call():
        _train_kernel[(programs,)](*descs, m, n, k, programs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                   GROUP_M=8, SEGMENTS=segments, DOT_IN_FP32=interpreting(), num_warps=8,
                                   num_stages=3 if block_n == 256 else 4)
        return c
    return call, c


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


def check_bits() -> list[str]:
    """The decode form's rows against the training form's, bitwise, per S; each against today's matmul."""
    g = torch.Generator().manual_seed(0)
    lines = ["| product | S | decode rows 1 / 64 / 256 = training rows (16,384) | = today's `matmul` |",
             "|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        x = torch.randn(16384, k, generator=g).cuda().bfloat16()
        w = (torch.randn(n, k, generator=g) / 45).cuda().bfloat16()
        today = _bits(mm.matmul(x, w.t()))
        for segments in (1, 2, 4):
            full = _bits(train(x, w, segments, 256)[0]())
            same = all(torch.equal(_bits(decode(x[at: at + rows].contiguous(), w, segments, bn)[0]()),
                                   full[at: at + rows])
                       for rows, at in ((1, 5), (64, 640), (256, 9000)) for bn in (64, 128))
            same_128 = torch.equal(_bits(train(x, w, segments, 128)[0]()), full)
            lines.append(f"| {name} | {segments} | {'yes' if same and same_128 else '**no**'} | "
                         f"{'yes' if torch.equal(full, today) else 'no'} |")
            print(lines[-1], flush=True)
    return lines


def decode_products(copy: float) -> list[str]:
    lines = ["| product | rows | form | us | floor us | / floor | today / this |", "|---|---|---|---|---|---|---|"]
    for rows in (64, 256):
        for name, (n, k) in SHAPES.items():
            def fresh():
                return (torch.randn(rows, k, device="cuda").bfloat16(),
                        (torch.randn(n, k, device="cuda") / 45).bfloat16())

            def today():
                x, w = fresh()
                return lambda: mm.matmul(x, w.t())

            forms = {"today (matmul, PDL)": today}
            for segments in (1, 2, 4):
                for bn in (64, 128):
                    forms[f"S={segments}, 64x{bn}"] = (lambda s, b: lambda: decode(*fresh(), s, b)[0])(segments, bn)
            times = {f: [] for f in forms}
            for _ in range(2):   # two rounds, alternating
                for f, make in forms.items():
                    with pdl():
                        times[f].append(gpu_ms(make, (rows + n) * k * 2) * 1e3)
            floor = n * k * 2 / copy / 1e3
            base = statistics.median(times["today (matmul, PDL)"])
            for f in forms:
                us = statistics.median(times[f])
                lines.append(f"| {name} | {rows} | {f} | {us:.1f} | {floor:.1f} | {us / floor:.2f} | "
                             f"{base / us:.2f}x |")
                print(lines[-1], flush=True)
    return lines


def train_products() -> list[str]:
    rows = 16384
    lines = ["| product | form | ms | TFLOP/s | today / this |", "|---|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        x = torch.randn(rows, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / 45).bfloat16()
        forms = {"today (matmul)": lambda: (lambda: mm.matmul(x, w.t()))}
        for segments in (1, 2, 4):
            for bn in (256, 128):
                forms[f"S={segments}, 128x{bn}"] = (lambda s, b: lambda: train(x, w, s, b)[0])(segments, bn)
        times = {f: [] for f in forms}
        for _ in range(2):
            for f, make in forms.items():
                times[f].append(gpu_ms(make, (rows + n) * k * 2))
        base = statistics.median(times["today (matmul)"])
        for f in forms:
            ms = statistics.median(times[f])
            lines.append(f"| {name} | {f} | {ms:.3f} | {2 * rows * n * k / ms / 1e9:.0f} | {base / ms:.2f}x |")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--parts", nargs="+", default=["bits", "decode", "train"], choices=["bits", "decode", "train"])
    args = ap.parse_args()
    copy = copy_gbs()[0]
    lines = [header(), "", f"Copy bandwidth (the floor's): {copy:,.0f} GB/s", ""]
    if "bits" in args.parts:
        lines += ["### Bits", ""] + check_bits() + [""]
    if "decode" in args.parts:
        lines += ["### Decode products", ""] + decode_products(copy) + [""]
    if "train" in args.parts:
        lines += ["### Training products at 16,384 rows", ""] + train_products() + [""]
    emit(lines, args.out)


if __name__ == "__main__":
    main()

"""Offline tuning of the invariant matmul's tile buckets (GPU only).

For each candidate config: (1) does it give the same bits as the reference
config on every row (a bucket may only be used if it does), (2) its time
against cuBLAS on the Qwen3-1.7B projection shapes. The chosen table is then
written into `workbench/kernels/matmul.py` by hand: nothing is tuned at run time.

    python tools/tune/tune_matmul.py            # every candidate on the projection shapes, M = 1 ... 8192
    python tools/tune/tune_matmul.py --decode   # decode steps: a layer's products + the LM head at M = 64, 128, 256
    python tools/tune/tune_matmul.py --decode-projections   # each decode product: table, narrow tiles, split-K, fused
    python tools/tune/tune_matmul.py --decode-tiles [M ...]   # a grid of tiles per decode product and M bucket (or
                                                         # one bucket of the given Ms), bits checked
    python tools/tune/tune_matmul.py --swiglu-tiles [M ...]   # the same for the SwiGLU product (gate+up + activation)
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))  # bench/timing.py
from timing import gpu_ms  # noqa: E402

from workbench.kernels import matmul as mm  # noqa: E402
from workbench.kernels import matmul_tiles as mt  # noqa: E402

SHAPES = [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048), (2048, 151936)]
MS = [1, 8, 32, 128, 512, 2048, 8192]
# One decoder layer's products at the Qwen3-1.7B shape (K, N): q, k, v, o, gate, up, down; and the LM head.
LAYER = [(2048, 2048), (2048, 1024), (2048, 1024), (2048, 2048), (2048, 6144), (2048, 6144), (6144, 2048)]
LAYERS, LM_HEAD = 28, (2048, 151936)
DECODE_CANDIDATES = [
    mt.MatmulConfig(16, 64, 128, 8, 4, 4),
    mt.MatmulConfig(16, 32, 128, 8, 4, 6),
    mt.MatmulConfig(32, 64, 128, 8, 4, 4),
    mt.MatmulConfig(64, 64, 64, 8, 4, 4),
    mt.MatmulConfig(64, 32, 64, 8, 4, 6),
    mt.MatmulConfig(64, 32, 128, 8, 4, 4),
    mt.MatmulConfig(64, 64, 128, 8, 4, 4),
    mt.MatmulConfig(64, 64, 64, 8, 4, 6),
    mt.MatmulConfig(64, 128, 64, 8, 4, 4),
    mt.MatmulConfig(128, 64, 64, 8, 4, 4),
    mt.MatmulConfig(128, 128, 64, 8, 8, 4),
]
CANDIDATES = [
    mt.MatmulConfig(128, 256, 64, 8, 8, 3),
    mt.MatmulConfig(16, 64, 64, 8, 4, 4),
    mt.MatmulConfig(16, 64, 64, 8, 4, 6),
    mt.MatmulConfig(16, 32, 64, 8, 4, 6),
    mt.MatmulConfig(16, 64, 128, 8, 4, 4),
    mt.MatmulConfig(16, 128, 64, 8, 4, 4),
    mt.MatmulConfig(64, 64, 64, 8, 4, 4),
    mt.MatmulConfig(64, 128, 64, 8, 4, 4),
    mt.MatmulConfig(128, 128, 64, 8, 4, 4),
    mt.MatmulConfig(128, 128, 64, 8, 8, 4),
    mt.MatmulConfig(128, 256, 64, 8, 8, 4),
    mt.MatmulConfig(256, 128, 64, 8, 8, 3),
    mt.MatmulConfig(128, 128, 64, 8, 8, 4, persistent=True),
    mt.MatmulConfig(128, 256, 64, 8, 8, 3, persistent=True),
    mt.MatmulConfig(256, 128, 64, 8, 8, 3, persistent=True),
]


def run_with(cfg, a, b):
    saved = mt.MATMUL_BUCKETS, mt.WIDE_BUCKETS, mt.DECODE_WIDTHS
    mt.MATMUL_BUCKETS, mt.WIDE_BUCKETS, mt.DECODE_WIDTHS = ((1 << 62, cfg),), (), ()
    try:
        return mm.matmul(a, b)
    finally:
        mt.MATMUL_BUCKETS, mt.WIDE_BUCKETS, mt.DECODE_WIDTHS = saved


def decode() -> None:
    """A decode step's products (28 layers + the LM head) per candidate, at the batch sizes of issue 16, against
    cuBLAS and the weights' byte floor; and each candidate's bits against the current table's."""
    dev = "cuda"
    x = torch.randn(300, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16) / 2048**0.5
    ref = mm.matmul(x, w.t())
    for cfg in DECODE_CANDIDATES:
        print(f"  {cfg}: same bits as the table: {torch.equal(run_with(cfg, x, w.t()), ref)}")
    for m in (64, 128, 256):
        def total(fn) -> float:
            ms = 0.0
            for (k, n), times in [(s, LAYERS) for s in LAYER] + [(LM_HEAD, 1)]:
                def call(k=k, n=n):
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                    return lambda: fn(a, b)
                ms += times * gpu_ms(call, 2 * (m * k + n * k + m * n))
            return ms
        floor = sum(2 * k * n for k, n in LAYER) * LAYERS + 2 * LM_HEAD[0] * LM_HEAD[1]
        print(f"M = {m}: cuBLAS {total(F.linear):.2f} ms, table {total(lambda a, b: mm.matmul(a, b.t())):.2f} ms, "
              f"weights {floor / 1e9:.2f} GB", flush=True)
        for cfg in DECODE_CANDIDATES:
            print(f"  {cfg}: {total(lambda a, b, cfg=cfg: run_with(cfg, a, b.t())):.2f} ms", flush=True)


def split_k(a, b, seg: int, bk: int = 128):
    """a @ b with K cut into slices of `seg` (fp32 partials, each its own chain of k-steps) summed in slice
    order: what a decode product costs with a shape-only split (pointer loads; the sum a separate kernel)."""
    m, k = a.shape
    n = b.shape[1]
    splits = triton.cdiv(k, seg)
    parts = torch.empty((splits, m, n), device=a.device, dtype=torch.float32)
    cfg = mt.MatmulConfig(64, 64, bk, 8, 4, 4)
    mm._matmul_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), splits)](
        a, b, parts, m, n, k, seg, a.stride(0), a.stride(1), b.stride(0), b.stride(1), parts.stride(1),
        parts.stride(2), parts.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=bk, GROUP_M=8,
        EVEN_K=True, DOT_IN_FP32=False, IEEE=False, ACCUMULATE=False, PDL=False, num_warps=4, num_stages=4)
    return parts.sum(0).to(a.dtype)


def decode_projections() -> None:
    """Each decode product of the Qwen3-1.7B shape at M = 64 and 256, microseconds (cold L2, in a CUDA graph):
    cuBLAS, the table, narrow 16-column tiles, split-K by 512 and 1,024, and q/k/v and gate/up as one product
    (their weights side by side: the same chains, so the same bits); the byte floor at 3.0 TB/s beside them."""
    dev = "cuda"
    narrow = mt.MatmulConfig(64, 16, 128, 8, 4, 4)
    shapes = {"q": (2048, 2048), "k or v": (2048, 1024), "o": (2048, 2048), "gate or up": (2048, 6144),
              "down": (6144, 2048), "lm_head": LM_HEAD, "q+k+v fused": (2048, 4096), "gate+up fused": (2048, 12288)}
    x = torch.randn(64, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16) / 2048**0.5
    print("narrow tiles, same bits as the table:", torch.equal(run_with(narrow, x, w.t()), mm.matmul(x, w.t())))
    for m in (64, 256):
        print(f"M = {m}: | product | K x N | floor us | cuBLAS | table | 64x16x128 | split-K 512 | split-K 1024 |")
        for name, (k, n) in shapes.items():
            def time(fn, k=k, n=n) -> float:
                def call():
                    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                    return lambda: fn(a, b)
                return 1e3 * gpu_ms(call, 2 * (m * k + n * k + m * n))
            row = [time(F.linear), time(lambda a, b: mm.matmul(a, b.t())),
                   time(lambda a, b: run_with(narrow, a, b.t())),
                   time(lambda a, b: split_k(a, b.t(), 512)), time(lambda a, b: split_k(a, b.t(), 1024))]
            floor = 2 * (m * k + n * k + m * n) / 3.0e6
            print(f"| {name} | {k} x {n} | {floor:.1f} | " + " | ".join(f"{t:.1f}" for t in row) + " |", flush=True)


def _tile_grid() -> list:
    """Tile shapes for the decode buckets: every M x N x K tile of the grid, with as many stages (6, 4 or 3)
    as fit in ~200 KiB of shared memory and 8 warps from 128 x 128 or 256 rows on; two persistent ones for
    M = 512. 256-row tiles read a 256-row batch's weights once where 64-row ones read them four times."""
    grid = []
    for bm, bn, bk in itertools.product((16, 32, 64, 128, 256), (16, 32, 64, 128, 256), (64, 128, 256)):
        stages = [s for s in (6, 4, 3) if s * (bm * bk + bk * bn) * 2 <= 200 * 1024]
        if stages and bm * bn <= 128 * 256:
            grid.append(mt.MatmulConfig(bm, bn, bk, 8, 8 if bm * bn >= 128 * 128 or bm == 256 else 4, stages[0]))
    return grid + [mt.MatmulConfig(128, 256, 64, 8, 8, 3, persistent=True),
                   mt.MatmulConfig(128, 128, 64, 8, 8, 4, persistent=True)]


def _same_bits(grid: list, run, x: torch.Tensor, ref: torch.Tensor, whose: str) -> list:
    """The configs of `grid` whose rows, all of x's and row 7 alone, are `ref`'s bit for bit (those that do not fit
    the shared memory left out)."""
    kept = []
    for cfg in grid:
        try:
            same = torch.equal(run(cfg, x), ref) and torch.equal(run(cfg, x[7:8]), ref[7:8])
        except triton.runtime.errors.OutOfResources:
            continue
        if same:
            kept.append(cfg)
        else:
            print(f"  {cfg}: NOT {whose} bits; dropped", flush=True)
    print(f"{len(kept)} of {len(grid)} tiles give {whose} bits", flush=True)
    return kept


def decode_tiles(ms: tuple[int, ...] = ()) -> None:
    """Each decode product of the Qwen3-1.7B shape (q+k+v and gate+up as the generator runs them, one product
    each) at the M of each decode bucket, us per product (cold L2, in a CUDA graph), for every tile of
    `_tile_grid` that gives the table's bits: per bucket and product the best five against the table and
    cuBLAS, then what a decode step's products cost with one config per bucket and with one per product."""
    dev = "cuda"
    torch.manual_seed(0)
    products = {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048),
                "lm_head": LM_HEAD}
    per_step = {"qkv": LAYERS, "o": LAYERS, "gate_up": LAYERS, "down": LAYERS, "lm_head": 1}
    buckets = {max(ms): ms} if ms else {32: (16, 32), 128: (64, 128), 512: (256, 512)}
    x = torch.randn(300, 6144, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device=dev, dtype=torch.bfloat16) / 6144**0.5
    ref = mm.matmul(x, w.t())
    grid = _same_bits(_tile_grid(), lambda cfg, a: run_with(cfg, a, w.t()), x, ref, "the table's")

    def time(fn, m, k, n) -> float:
        def call():
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            return lambda: fn(a, b)
        return 1e3 * gpu_ms(call, 2 * (m * k + n * k + m * n), reps=10)

    for top, ms in buckets.items():
        table = {}
        cublas = {}
        times = {}                       # (product, cfg index) -> us summed over the bucket's M
        for name, (k, n) in products.items():
            table[name] = sum(time(lambda a, b: mm.matmul(a, b.t()), m, k, n) for m in ms)
            cublas[name] = sum(time(F.linear, m, k, n) for m in ms)
            for i, cfg in enumerate(grid):
                times[name, i] = sum(time(lambda a, b, cfg=cfg: run_with(cfg, a, b.t()), m, k, n) for m in ms)
            best = sorted(range(len(grid)), key=lambda i, name=name: times[name, i])[:5]
            print(f"M in {ms} | {name} {k} x {n} | cuBLAS {cublas[name]:.1f} | table {table[name]:.1f} | "
                  + " | ".join(f"{grid[i].block_m}x{grid[i].block_n}x{grid[i].block_k} w{grid[i].num_warps} "
                               f"s{grid[i].num_stages}{' p' if grid[i].persistent else ''} {times[name, i]:.1f}"
                               for i in best), flush=True)

        def step(t) -> float:
            return sum(per_step[name] * t(name) for name in products) / len(ms) / 1e3

        one = min(range(len(grid)), key=lambda i: step(lambda name: times[name, i]))
        print(f"M in {ms}, a decode step's products, ms: cuBLAS {step(cublas.get):.3f}, table {step(table.get):.3f}, "
              f"best single {grid[one]} {step(lambda name: times[name, one]):.3f}, best per product "
              f"{step(lambda name: min(times[name, i] for i in range(len(grid)))):.3f}", flush=True)


def swiglu_tiles(ms: tuple[int, ...]) -> None:
    """The SwiGLU product (`kernels/swiglu_product.py`) of the Qwen3-1.7B shape at each M, us (cold L2, in a CUDA
    graph), for every tile of a grid like `_tile_grid`'s (stages fitted to two weight tiles a stage) whose bits are
    the unfused ops'; the best five against today's config and cuBLAS's packed gate+up product alone (no activation)."""
    sp = importlib.import_module("workbench.kernels.swiglu_product")  # the package exports the function's name
    from workbench.kernels.silu_mul import silu_mul_invariant as silu_mul

    dev = "cuda"
    torch.manual_seed(0)
    k, inter = 2048, 6144

    def run(cfg, a, w):
        saved = sp._CONFIGS
        sp._CONFIGS = ((sp.MAX_ROWS, cfg),)
        try:
            return sp.swiglu_product(a, w)
        finally:
            sp._CONFIGS = saved

    grid = []
    for bm, bn, bk in itertools.product((64, 128, 256), (32, 64, 128), (64, 128)):
        stages = [s for s in (6, 4, 3, 2) if s * (bm + 2 * bn) * bk * 2 <= 200 * 1024]
        for warps in (8,) if bm == 256 else (4, 8):
            grid += [mt.MatmulConfig(bm, bn, bk, 8, warps, stages[0])] if stages else []
    x = torch.randn(max(ms), k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device=dev, dtype=torch.bfloat16) / k**0.5
    ref = silu_mul(mm.matmul(x, w[:inter].t()), mm.matmul(x, w[inter:].t()))
    kept = _same_bits(grid, lambda cfg, a: run(cfg, a, w), x, ref, "the unfused ops'")
    for m in ms:
        def time(fn) -> float:
            def call():
                a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                b = torch.randn(2 * inter, k, device=dev, dtype=torch.bfloat16)
                return lambda: fn(a, b)
            return 1e3 * gpu_ms(call, 2 * (m * k + 2 * inter * k + m * inter), reps=10)

        today = time(sp.swiglu_product)
        cublas = time(F.linear)
        times = sorted(((time(lambda a, b, cfg=cfg: run(cfg, a, b)), cfg) for cfg in kept), key=lambda tc: tc[0])
        print(f"M {m} | today {sp.fused_config(m, x.device)} {today:.1f} | cuBLAS gate+up alone {cublas:.1f} | "
              + " | ".join(f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} {t:.1f}"
                           for t, c in times[:5]), flush=True)


def _ms_after(flag: str) -> tuple[int, ...]:
    rest = sys.argv[sys.argv.index(flag) + 1:]
    return tuple(int(a) for a in itertools.takewhile(str.isdigit, rest))


def main() -> None:
    if "--decode-tiles" in sys.argv:
        decode_tiles(_ms_after("--decode-tiles"))
        return
    if "--swiglu-tiles" in sys.argv:
        swiglu_tiles(_ms_after("--swiglu-tiles") or (64, 128, 256, 512))
        return
    if "--decode-projections" in sys.argv:
        decode_projections()
        return
    if "--decode" in sys.argv:
        decode()
        return
    torch.manual_seed(0)
    dev = "cuda"
    # 1. bitwise agreement of every candidate with the first 128x256 one.
    k, n = 2048, 4096
    x = torch.randn(300, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
    ref = run_with(CANDIDATES[0], x, w.t())
    # The pointer kernel, reached through a row stride TMA cannot take (not a multiple of 16 bytes).
    x_odd = torch.empty(300, k + 1, device=dev, dtype=torch.bfloat16)[:, :k].copy_(x)
    print("pointer kernel equal:", torch.equal(run_with(CANDIDATES[0], x_odd, w.t()), ref))
    print("bitwise vs the first candidate:")
    for cfg in list(CANDIDATES):
        try:
            out = run_with(cfg, x, w.t())
        except triton.runtime.errors.OutOfResources as e:
            print(f"  {cfg}: does not fit ({e}); dropped")
            CANDIDATES.remove(cfg)
            continue
        one = run_with(cfg, x[5:6], w.t())
        print(f"  {cfg}: equal={torch.equal(out, ref)} maxdiff={(out.float()-ref.float()).abs().max().item():.3g}"
              f" row5_alone_equal={torch.equal(one, ref[5:6])}")
    # 2. timings.
    print(f"{'K':>5} {'N':>7} {'M':>5} {'cublas_us':>9} " + " ".join(f"c{i}" for i in range(len(CANDIDATES))))
    for (k, n), m in itertools.product(SHAPES, MS):
        nbytes = 2 * (m * k + n * k + m * n)

        def make(fn):
            def call():
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                return lambda: fn(x, w)
            return call

        t_ref = gpu_ms(make(F.linear), nbytes)
        ratios = [t_ref / gpu_ms(make(lambda x, w, cfg=cfg: run_with(cfg, x, w.t())), nbytes) for cfg in CANDIDATES]
        print(f"{k:>5} {n:>7} {m:>5} {t_ref*1e3:9.1f} " + " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()

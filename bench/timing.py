"""GPU timing shared by the benchmark scripts.

`gpu_ms(make_call, nbytes)` builds several independent input sets, so that
together they exceed the L2 cache several times over, captures one CUDA graph
that runs the call once on each set, and reports the median replay time per
call. So: no Python launch overhead (graphs), and no cache-warm inputs (each
call's operands were evicted by the calls before it).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from workbench.kernels import FUSED_ROWWISE, mode

L2_MULTIPLE = 4
MAX_SETS = 1024


def gpu_ms(make_call: Callable[[], Callable[[], object]], nbytes: int, reps: int = 20) -> float:
    """make_call() returns a zero-argument call bound to fresh inputs of `nbytes` bytes; median ms per call."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    n_sets = max(1, min(MAX_SETS, -(-L2_MULTIPLE * l2 // max(nbytes, 1))))
    return graph_ms([make_call() for _ in range(n_sets)], reps)


def graph_ms(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median ms per call of one CUDA graph that runs `calls` in order (each run once first, outside the graph:
    compilation, allocator, autotune of the baselines)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def copy_gbs() -> tuple[float, float]:
    """Device-to-device copy of 1 GiB, bytes read + written per second (GB/s):
    (a Triton copy kernel in a CUDA graph, torch's copy_ timed with events)."""
    n = 1 << 29
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    block = 8192
    kernel_ms = gpu_ms(lambda: (lambda: _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=8)),
                       4 * n)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 4 * n / kernel_ms / 1e6, 4 * n / statistics.median(times) / 1e6


# Dense bf16 tensor-core peaks (no sparsity), by device name.
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), float("nan"))


# The kernel modes the benchmarks compare: (default, per-op overrides). `standard-fused` is the fast standard
# baseline (`kernels.FUSED_ROWWISE`): cuBLAS and FlashAttention, the row-wise ops fused. Liger's kernels are the
# ecosystem's version of that fusion; ours are used so the baseline needs nothing installed. `standard` is Hugging
# Face's eager formulas, op for op.
MODES = {"invariant": ("invariant", {}), "standard-fused": ("standard", FUSED_ROWWISE), "standard": ("standard", {})}


def in_mode(name: str):
    """The kernel-mode context of one of `MODES`."""
    default, overrides = MODES[name]
    return mode(default, **overrides)


def with_grad(fn, args, grad_idx):
    """A call running forward and backward of fn(*args) (autograd's backward runs on the forward's
    stream, so both must sit inside the CUDA graph)."""
    args = [a.detach().requires_grad_(True) if i in grad_idx else a for i, a in enumerate(args)]
    g = torch.randn_like(fn(*args))
    grads = [args[i] for i in grad_idx]
    return lambda: torch.autograd.grad(fn(*args), grads, g)


def header() -> str:
    """The first line of every benchmark table: device, versions, date, commit."""
    import datetime

    from workbench.env import git_sha

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
    return (f"Device: {device}; torch {torch.__version__}, triton {triton.__version__}; "
            f"{datetime.date.today().isoformat()}; git {git_sha()}")


def emit(lines: list[str], out: str | None) -> None:
    """Print the tables, and write them to `out` when given."""
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")

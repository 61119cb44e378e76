"""GPU benchmark of checkpoint loading: `load_pretrained` of a Qwen3-1.7B-shape bf16 safetensors checkpoint
onto the GPU from a warm page cache, beside the same run's baselines: safetensors' own `load_file` onto the
GPU (the bytes alone, no model), and transformers' `from_pretrained(device_map='cuda')`. The floor is the
file's bytes over the measured host-to-device copy rate from pinned memory.

    python bench/bench_load.py [--out FILE.md] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from timing import emit, header

from workbench.models import build, load_pretrained, save_pretrained


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        del out
        torch.cuda.empty_cache()
    return statistics.median(times)


def h2d_gbs(nbytes: int = 1 << 30) -> float:
    """Host-to-device copy rate from pinned memory (GB/s)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_load.py needs a CUDA GPU")
    import transformers
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(build("qwen3-1.7B", device="cpu", dtype=torch.bfloat16, seed=0), d)
        f = Path(d) / "model.safetensors"
        nbytes = f.stat().st_size
        f.read_bytes()  # warm the page cache
        rows = {
            "workbench load_pretrained": _median_s(lambda: load_pretrained(d, device="cuda"), a.repeats),
            "safetensors load_file (bytes only)": _median_s(lambda: load_file(f, device="cuda"), a.repeats),
            "transformers from_pretrained": _median_s(lambda: transformers.AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.bfloat16, device_map="cuda"), a.repeats),
        }
    floor = nbytes / h2d_gbs() / 1e9
    lines = [header(), "", f"Qwen3-1.7B shape, bf16, one {nbytes / 1e9:.2f} GB safetensors file, warm page cache, "
             f"median of {a.repeats}.", "", "| loader | seconds | / floor |", "|---|---|---|"]
    lines += [f"| {name} | {s:.2f} | {s / floor:.1f} |" for name, s in rows.items()]
    lines += [f"| floor: bytes / pinned host-to-device rate | {floor:.2f} | 1.0 |"]
    emit(lines, a.out)


if __name__ == "__main__":
    main()

"""GPU benchmark of the kernel library against its baselines, measured in the same run.

- linear: TFLOP/s of the invariant kernel and of cuBLAS (`F.linear`) on the
  Qwen3-1.7B projection shapes, forward and backward (dx + dW), and the ratio.
- rms_norm, silu_mul, token_logprobs (+ entropy), apply_rope: GB/s of the
  invariant kernel and of the standard PyTorch path, against a device-to-device
  copy measured here (bytes read + written).

    python bench/bench_kernels.py [--out FILE.md] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import torch.nn.functional as F
import triton

from workbench.kernels import REGISTRY

SHAPES = [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048), (2048, 151936)]
MS = [1, 8, 32, 128, 512, 2048, 8192]


def bench(fn) -> float:
    """Median milliseconds of GPU time: CUDA-graph replays, so Python launch overhead is left out."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    src = torch.empty(1 << 29, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def _fwd_bwd(fn, args, grad_idx):
    args = [a.detach().requires_grad_(True) if i in grad_idx else a for i, a in enumerate(args)]
    out = fn(*args)
    g = torch.randn_like(out)
    grads = [args[i] for i in grad_idx]
    return lambda: torch.autograd.grad(out, grads, g, retain_graph=True)


def linear_rows(quick: bool):
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    inv, std = REGISTRY["linear"].invariant, REGISTRY["linear"].standard
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
        for m in MS if not quick else [1, 128, 2048]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            flop = 2 * m * n * k
            t_inv, t_std = bench(lambda: inv(x, w)), bench(lambda: F.linear(x, w))
            rows.append(("fwd", k, n, m, flop / t_inv / 1e9, flop / t_std / 1e9))
            if m in (8, 128, 2048, 8192):
                b_inv = _fwd_bwd(inv, [x, w], (0, 1))
                b_std = _fwd_bwd(std, [x, w], (0, 1))
                t_inv, t_std = bench(b_inv), bench(b_std)
                rows.append(("bwd", k, n, m, 2 * flop / t_inv / 1e9, 2 * flop / t_std / 1e9))
    return rows


def rowwise_rows(copy_gbs: float):
    """(op, pass, shape, bytes moved, invariant ms, standard ms)."""
    g = torch.Generator().manual_seed(1)
    cases = [("rms_norm", 8192), ("rms_norm", 64), ("silu_mul", 8192), ("silu_mul", 64),
             ("apply_rope", 8192), ("token_logprobs", 4096), ("token_logprobs", 64)]
    rows = []
    for name, m in cases:
        op = REGISTRY[name]
        args = op.make_inputs(m, "real", g, "cuda", torch.bfloat16)
        elems = args[0].numel()
        # Bytes the op must move at least: each bf16 input read once, each output written once.
        fwd_bytes, bwd_bytes = {
            "rms_norm": (2 * elems * 2, 3 * elems * 2),
            "silu_mul": (3 * elems * 2, 5 * elems * 2),
            "apply_rope": (2 * elems * 2, 2 * elems * 2),
            "token_logprobs": (elems * 2, 2 * elems * 2),
        }[name]
        shape = "x".join(str(s) for s in args[0].shape)
        t_inv, t_std = bench(lambda: op.invariant(*args)), bench(lambda: op.standard(*args))
        rows.append((name, "fwd", shape, fwd_bytes, t_inv, t_std))
        b_inv, b_std = _fwd_bwd(op.invariant, list(args), op.grad_args), _fwd_bwd(op.standard, list(args), op.grad_args)
        rows.append((name, "bwd", shape, bwd_bytes, bench(b_inv), bench(b_std)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    lines = [
        f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.date.today().isoformat()}, host {platform.node()}",
        "",
        "| pass | K | N | M | invariant TFLOP/s | cuBLAS TFLOP/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, k, n, m, ti, ts in linear_rows(a.quick):
        lines.append(f"| {p} | {k} | {n} | {m} | {ti:.1f} | {ts:.1f} | {ti / ts:.2f} |")
    copy = copy_bandwidth()
    lines += [
        "",
        f"Device-to-device copy: {copy:.0f} GB/s (bytes read + written).",
        "",
        "| op | pass | shape | invariant GB/s | / copy | standard GB/s | / copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p, shape, nbytes, ti, ts in rowwise_rows(copy):
        gi, gs = nbytes / ti / 1e6, nbytes / ts / 1e6
        lines.append(f"| {name} | {p} | {shape} | {gi:.0f} | {gi / copy:.2f} | {gs:.0f} | {gs / copy:.2f} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

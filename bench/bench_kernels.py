"""GPU benchmark of the kernel library against its baselines, measured in the same run.

- linear: TFLOP/s of the invariant kernel and of cuBLAS (`F.linear`) on the
  Qwen3-1.7B projection shapes, forward, forward + backward (y, dx, dW: three
  products) and the backward alone (their difference), and the ratio.
- rms_norm, silu_mul, apply_rope, token_logprobs (with entropy's kernel):
  GB/s of the invariant kernel and of the standard PyTorch path, against a
  device-to-device copy measured here (bytes read + written). Bytes are the
  fewest the op must move: each input read once, each output written once.

Times are GPU time per call (CUDA graphs, inputs rotated past the L2 cache;
see bench/timing.py).

    python bench/bench_kernels.py [--out FILE.md] [--quick]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from timing import copy_gbs, emit, gpu_ms, header, with_grad

from workbench.kernels import REGISTRY

SHAPES = [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048), (2048, 151936)]
MS = [1, 8, 32, 128, 512, 2048, 8192]
BACKWARD_MS = (8, 128, 2048, 8192)


def linear_rows(quick: bool):
    inv = REGISTRY["linear"].invariant
    rows = []
    for k, n in SHAPES:
        for m in [1, 128, 2048] if quick else MS:
            nbytes = 2 * (m * k + n * k + m * n)

            def make(fn, grad=False):
                def call():
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
                    return with_grad(fn, [x, w], (0, 1)) if grad else (lambda: fn(x, w))
                return call

            flop = 2 * m * n * k
            t_inv, t_std = gpu_ms(make(inv), nbytes), gpu_ms(make(F.linear), nbytes)
            rows.append(("fwd", k, n, m, flop / t_inv / 1e9, flop / t_std / 1e9))
            if m in BACKWARD_MS:
                tb_inv, tb_std = gpu_ms(make(inv, True), 2 * nbytes), gpu_ms(make(F.linear, True), 2 * nbytes)
                rows.append(("fwd+bwd", k, n, m, 3 * flop / tb_inv / 1e9, 3 * flop / tb_std / 1e9))
                # The backward alone (dx, dW), as the difference of the two timings.
                rows.append(("bwd", k, n, m, 2 * flop / (tb_inv - t_inv) / 1e9, 2 * flop / (tb_std - t_std) / 1e9))
    return rows


# op -> (bytes of the forward, bytes of forward + backward), in elements of x (bf16, 2 bytes each)
_TRAFFIC = {
    "rms_norm": (2, 2 + 3),
    "silu_mul": (3, 3 + 5),
    "apply_rope": (2, 2 + 2),
    "token_logprobs": (1, 1 + 2),
}
_CASES = [("rms_norm", 8192), ("rms_norm", 64), ("silu_mul", 8192), ("silu_mul", 64),
          ("apply_rope", 8192), ("token_logprobs", 4096), ("token_logprobs", 64)]


def rowwise_rows():
    """(op, pass, shape, bytes, invariant ms, standard ms)."""
    rows = []
    for name, m in _CASES:
        op = REGISTRY[name]
        row = op.make_inputs(1, "real", torch.Generator(), "cpu", torch.bfloat16)[0]
        elems = m * row.numel()
        shape = "x".join(str(s) for s in (m, *row.shape[1:]))
        for label, grad, factor in (("fwd", False, _TRAFFIC[name][0]), ("fwd+bwd", True, _TRAFFIC[name][1])):
            nbytes = 2 * elems * factor

            def make_for(fn):
                def call():
                    args = op.make_inputs(m, "real", torch.Generator().manual_seed(0), "cuda", torch.bfloat16)
                    return with_grad(fn, list(args), op.grad_args) if grad else (lambda: fn(*args))
                return call

            rows.append((name, label, shape, nbytes, gpu_ms(make_for(op.invariant), nbytes),
                         gpu_ms(make_for(op.standard), nbytes)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    lines = [
        header(),
        "",
        "| pass | K | N | M | invariant TFLOP/s | cuBLAS TFLOP/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for p, k, n, m, ti, ts in linear_rows(a.quick):
        lines.append(f"| {p} | {k} | {n} | {m} | {ti:.1f} | {ts:.1f} | {ti / ts:.2f} |")
    copy_kernel, copy_torch = copy_gbs()
    copy = max(copy_kernel, copy_torch)
    lines += [
        "",
        f"Device-to-device copy of 1 GiB: {copy_kernel:.0f} GB/s by a Triton copy kernel, {copy_torch:.0f} GB/s by "
        f"torch's copy_ (bytes read + written); ratios below are against {copy:.0f} GB/s.",
        "",
        "| op | pass | shape | invariant GB/s | / copy | standard GB/s | / copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p, shape, nbytes, ti, ts in rowwise_rows():
        gi, gs = nbytes / ti / 1e6, nbytes / ts / 1e6
        lines.append(f"| {name} | {p} | {shape} | {gi:.0f} | {gi / copy:.2f} | {gs:.0f} | {gs / copy:.2f} |")
    emit(lines, a.out)


if __name__ == "__main__":
    main()

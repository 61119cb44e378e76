"""Tile search for attention's backward kernels (dK/dV and dQ) at the training shapes, against PyTorch SDPA's
flash backward (cuDNN's on Hopper) on the same tensors. The backward's tiles fix only the order of the
gradients' sums, never a forward bit, so they are picked for speed; each candidate's gradients are checked
against the current config's (bf16 sums in another order: close, not equal).

    python tools/tune/tune_attention.py [--batch 16] [--seq 1024]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))  # bench/timing.py
from timing import gpu_ms

import workbench.kernels.attention  # noqa: F401

att = sys.modules["workbench.kernels.attention"]

SHAPES = {"qwen3-1.7B": (16, 8, 128), "smollm2-135M": (9, 3, 64)}
# (block_m, block_n, num_warps, num_stages)
DKDV = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2),
        (64, 128, 8, 3), (16, 128, 4, 3), (16, 128, 8, 4), (32, 128, 8, 4), (128, 64, 8, 2)]
DQ = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 4),
      (64, 32, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2)]


def _cfg(t):
    return {"block_m": t[0], "block_n": t[1], "num_warps": t[2], "num_stages": t[3]}


def _event_ms(fn, reps: int = 10) -> float:
    """Median ms of `fn` timed with events (autograd cannot be captured in a graph; its kernels are long)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def run(b: int, t: int, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(b, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), t, device="cuda", dtype=torch.int32)
    out, lse = att._forward(q, k, v, torch.zeros_like(lens), lens, store_lse=True)
    nbytes = sum(x.numel() * x.element_size() for x in (q, k, v, do, out, lse))
    base = att.attention_bwd_config(d)
    ref = att._backward(q, k, v, out, lse, lens, do)[:3]
    whole = gpu_ms(lambda: lambda: att._backward(q, k, v, out, lse, lens, do), nbytes)

    qs, ks, vs = (x.detach().transpose(1, 2).requires_grad_(True) for x in (q, k, v))
    o_sdpa = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=hq != hkv)
    do_t = do.transpose(1, 2)
    sdpa = _event_ms(lambda: torch.autograd.grad(o_sdpa, (qs, ks, vs), do_t, retain_graph=True))
    flops = 2.5 * 4 * b * t * t * hq * d / 2
    print(f"\n## B={b} T={t} Hq={hq} Hkv={hkv} D={d}: backward now {whole:.3f} ms "
          f"({flops / whole / 1e9:.0f} TFLOP/s), SDPA flash backward {sdpa:.3f} ms; now: {base}")
    delta = torch.empty((b * hq, t), device="cuda", dtype=torch.float32)
    att._attn_bwd_delta_kernel[(triton.cdiv(t, 64) * b * hq,)](out, do, delta, out.stride(1), out.stride(2), hq, t,
                                                             BLOCK_M=64, HEAD_DIM=d)
    common = {"HEAD_DIM": d, "IEEE": False, "DOT_IN_FP32": False}
    qk, sm = att._LOG2E / math.sqrt(d), 1.0 / math.sqrt(d)
    print("| kernel | block_m | block_n | warps | stages | ms | max abs diff vs now |\n|---|---|---|---|---|---|---|")
    for tiles in DKDV:
        c = _cfg(tiles)
        dk, dv = torch.empty_like(k), torch.empty_like(v)

        def call(c=c, dk=dk, dv=dv):
            return lambda: att._attn_bwd_dkdv_kernel[(triton.cdiv(t, c["block_n"]) * b * hkv,)](
                q, k, v, do, lse, delta, dk, dv, lens, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
                k.stride(1), k.stride(2), hq, hkv, t, hq // hkv, qk, sm, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                num_warps=c["num_warps"], num_stages=c["num_stages"], **common)
        try:
            ms = gpu_ms(call, nbytes)
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory) is reported, not fatal
            print(f"| dkdv | {' | '.join(map(str, tiles))} | failed: {type(e).__name__} | |")
            continue
        diff = max(float((dk.float() - ref[1].float()).abs().max()), float((dv.float() - ref[2].float()).abs().max()))
        print(f"| dkdv | {' | '.join(map(str, tiles))} | {ms:.3f} | {diff:.3g} |")
    for tiles in DQ:
        c = _cfg(tiles)
        dq = torch.empty_like(q)

        def call(c=c, dq=dq):
            return lambda: att._attn_bwd_dq_kernel[(triton.cdiv(t, c["block_m"]) * b * hq,)](
                q, k, v, do, lse, delta, dq, lens, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                k.stride(2), hq, t, hq // hkv, qk, sm, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                num_warps=c["num_warps"], num_stages=c["num_stages"], **common)
        try:
            ms = gpu_ms(call, nbytes)
        except Exception as e:  # noqa: BLE001
            print(f"| dq | {' | '.join(map(str, tiles))} | failed: {type(e).__name__} | |")
            continue
        diff = float((dq.float() - ref[0].float()).abs().max())
        print(f"| dq | {' | '.join(map(str, tiles))} | {ms:.3f} | {diff:.3g} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for name, (hq, hkv, d) in SHAPES.items():
        print(f"\n# {name}")
        run(args.batch, args.seq, hq, hkv, d)


if __name__ == "__main__":
    main()

"""Probe: the decode attention kernel's num_stages / num_warps at the 1.7B shape, 28 layers' caches, graph-timed."""
import math, sys, torch, triton

import workbench.kernels.attention  # noqa
att = sys.modules["workbench.kernels.attention"]


def run(q, caches, kv, start, out, stages, warps):
    for k, v in caches:
        att._attn_decode_kernel[(q.shape[0] * 8,)](
            q, k, v, out, start, kv, q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(2), 8, k.shape[1], 2,
            att._LOG2E / math.sqrt(128), BLOCK_M=64, BLOCK_N=64, HEAD_DIM=128, IEEE=False, DOT_IN_FP32=False,
            num_warps=warps, num_stages=stages, PDL=False)

for B in (64, 256):
    g = torch.Generator(device="cuda").manual_seed(0)
    S = 384
    caches = [(torch.randn(B, S, 8, 128, device="cuda", generator=g).bfloat16(),
               torch.randn(B, S, 8, 128, device="cuda", generator=g).bfloat16()) for _ in range(28)]
    q = torch.randn(B, 1, 16, 128, device="cuda", generator=g).bfloat16()
    kv = torch.randint(129, 385, (B,), device="cuda", generator=g, dtype=torch.int32)
    start = kv - 1
    nbytes = int(kv.sum()) * 8 * 128 * 2 * 2 * 28
    base = None
    for stages, warps in ((2, 4), (3, 4), (4, 4), (5, 4), (2, 8), (3, 8), (4, 8)):
        out = torch.empty(B, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
        run(q, caches, kv, start, out, stages, warps)
        torch.cuda.synchronize()
        if base is None:
            base = out.clone()
        same = torch.equal(out, base)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            run(q, caches, kv, start, out, stages, warps)
        for _ in range(3): gr.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(15):
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
        ms = sorted(ts)[7]
        print(f"B={B} stages={stages} warps={warps}: {ms:.3f} ms for 28 layers, "
              f"floor {nbytes/3.0e12*1e3:.3f} ms, same bits as (2,4): {same}", flush=True)

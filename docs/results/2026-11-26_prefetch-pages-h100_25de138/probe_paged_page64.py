"""Probe: the paged decode attention with 16-key pages (a 64-key tile gathered from four) and 64-key pages (one
page a tile: `_paged_kv_loop`'s one-entry branch), beside the static cache's decode kernel, 1.7B shape, 28 layers'
caches in one CUDA graph. The same keys in every layout; bits compared with the static kernel's."""
import sys

import torch

import workbench.kernels.attention_paged  # noqa: F401
from workbench.kernels import attention_with_cache, mode

ap = sys.modules["workbench.kernels.attention_paged"]


def timed(fn) -> float:
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    for _ in range(3):
        gr.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(15):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return sorted(ts)[7]


S = 384
for n in (64, 256):
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randint(129, S + 1, (n,), device="cuda", generator=g, dtype=torch.int32)
    caches = [(torch.randn(n, S, 8, 128, device="cuda", generator=g).bfloat16(),
               torch.randn(n, S, 8, 128, device="cuda", generator=g).bfloat16()) for _ in range(28)]
    q = torch.randn(n, 16, 128, device="cuda", generator=g).bfloat16()
    nbytes = int(kv.sum()) * 8 * 128 * 2 * 2 * 28
    floor = nbytes / 3.0e12 * 1e3
    with mode("invariant"):
        start = (kv - 1).long()
        static = [attention_with_cache(q[:, None], k, v, start, kv) for k, v in caches]
        ms = timed(lambda: [attention_with_cache(q[:, None], k, v, start, kv) for k, v in caches])
        print(f"{n} sequences, static cache: {ms:.3f} ms for 28 layers (floor {floor:.3f})", flush=True)
        cu = torch.arange(n + 1, device="cuda", dtype=torch.int32)
        for page in (16, 64):
            per = S // page
            for placement in ("random", "in order"):
                order = (torch.randperm(n * per, device="cuda", generator=g) if placement == "random"
                         else torch.arange(n * per, device="cuda"))
                bt = order.view(n, per).int()
                layers = []
                for k, v in caches:
                    kp = torch.empty(n * per, page, 8, 128, device="cuda", dtype=torch.bfloat16)
                    vp = torch.empty_like(kp)
                    kp[order] = k.reshape(n * per, page, 8, 128)
                    vp[order] = v.reshape(n * per, page, 8, 128)
                    layers.append((kp, vp))
                outs = [ap.attention_paged(q, kp, vp, bt, cu, kv, 1) for kp, vp in layers]
                same = all(torch.equal(a, b[:, 0]) for a, b in zip(outs, static))
                ms = timed(lambda: [ap.attention_paged(q, kp, vp, bt, cu, kv, 1) for kp, vp in layers])
                print(f"{n} sequences, {page}-key pages {placement}: {ms:.3f} ms for 28 layers (floor {floor:.3f}), "
                      f"same bits as the static cache: {same}", flush=True)
                del layers
        torch.cuda.empty_cache()

"""Probe: the paged decode attention (vLLM's layout, as vLLM running the workbench model calls it) with 2 and 3
K/V tiles loaded ahead, 28 layers' pages, one CUDA graph; bits compared."""
import sys

import torch

import workbench.kernels.attention_paged  # noqa: F401
from workbench.kernels import mode

ap = sys.modules["workbench.kernels.attention_paged"]
base_cfg = ap.attention_config
PAGE = 16
for n in (64, 256):
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randint(129, 385, (n,), device="cuda", generator=g, dtype=torch.int32)
    per = 384 // PAGE
    pages = n * per
    layers = [(torch.randn(pages, PAGE, 8, 128, device="cuda", generator=g).bfloat16(),
               torch.randn(pages, PAGE, 8, 128, device="cuda", generator=g).bfloat16()) for _ in range(28)]
    random_bt = torch.randperm(pages, device="cuda", generator=g).view(n, per).int()
    q = torch.randn(n, 16, 128, device="cuda", generator=g).bfloat16()
    cu = torch.arange(n + 1, device="cuda", dtype=torch.int32)
    nbytes = int(kv.sum()) * 8 * 128 * 2 * 2 * 28
    ref = None
    for placement, bt, stages in (("random", random_bt, 2), ("random", random_bt, 3),
                                  ("in order", torch.arange(pages, device="cuda").view(n, per).int(), 3)):
        ap.attention_config = lambda d, s=stages: {**base_cfg(d), "decode_stages": s}
        with mode("invariant"):
            outs = [ap.attention_paged(q, k, v, bt, cu, kv, 1) for k, v in layers]
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for k, v in layers:
                    ap.attention_paged(q, k, v, bt, cu, kv, 1)
        torch.cuda.synchronize()
        ref = outs if ref is None else ref
        # Another block table reads other pages' keys: bits are compared between the stages of one placement.
        same = all(torch.equal(a, b) for a, b in zip(outs, ref)) if placement == "random" else "-"
        for _ in range(3):
            gr.replay()
        ts = []
        for _ in range(15):
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
        ms = sorted(ts)[7]
        print(f"paged, {n} sequences, pages {placement}, {stages} stages: {ms:.3f} ms for 28 layers "
              f"(floor {nbytes / 3.0e12 * 1e3:.3f}), same bits as 2 stages: {same}", flush=True)

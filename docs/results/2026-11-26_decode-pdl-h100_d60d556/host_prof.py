"""Host time per launch: a decode step's eager forward (no graph), timed and profiled (cProfile), per op."""
import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, "bench")
from timing import in_mode  # noqa: E402

from workbench.kernels import linear, rms_norm  # noqa: E402
from workbench.models import KVCache, build  # noqa: E402

model = build("qwen3-1.7B", device="cuda", dtype=torch.bfloat16, seed=0)
cfg = model.config
b = 64
cache = KVCache.allocate(cfg, b, 384, "cuda", torch.bfloat16)
tok = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
pos = torch.full((b,), 128, device="cuda", dtype=torch.int32)
ones = torch.ones_like(pos)
x = torch.randn(b, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
w = model.model.layers[0].self_attn.o_proj.weight


def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


with torch.no_grad(), in_mode("invariant"):
    step = lambda: model.hidden_states(tok, seq_lens=ones, cache=cache, start=pos)  # noqa: E731
    print(f"decode forward (28 layers), eager: {host_us(step, 20):.0f} us host", flush=True)
    print(f"linear [64,2048]x[2048,2048]: {host_us(lambda: linear(x, w)):.1f} us host", flush=True)
    print(f"F.linear (cuBLAS):            {host_us(lambda: torch.nn.functional.linear(x, w)):.1f} us host",
          flush=True)
    nw = model.model.layers[0].input_layernorm.weight
    print(f"rms_norm [64,2048]:           {host_us(lambda: rms_norm(x, nw)):.1f} us host", flush=True)
    for name, fn, n in (("decode forward", step, 20), ("linear", lambda: linear(x, w), 500)):
        pr = cProfile.Profile()
        fn()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
        print(f"==== {name} x{n}, by tottime\n" + s.getvalue()[-9000:], flush=True)

"""Scratch: one 16k-token micro-batch fwd+bwd (invariant), kernels grouped by (name, grid)."""
import collections, json, os, sys, time
import torch
sys.path.insert(0, "bench")
from bench_train import make_weights, make_batch, forward_backward, _timed
from timing import in_mode
from torch.profiler import ProfilerActivity, profile

out = os.environ.get("OUT", "/tmp")
w = make_weights("qwen3-1.7B")
batch = make_batch(16, 1024, w.model.config.vocab_size, seed=0)
mode = sys.argv[1] if len(sys.argv) > 1 else "invariant"
with in_mode(mode):
    forward_backward(w, batch, 16384)
    ts = [_timed(lambda: forward_backward(w, batch, 16384))[1] for _ in range(3)]
    print(mode, "fwd+bwd ms", [round(t * 1e3, 1) for t in ts])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward_backward(w, batch, 16384)
        torch.cuda.synchronize()
path = f"{out}/trace_{mode}.json"
prof.export_chrome_trace(path)
tr = json.load(open(path))
agg = collections.defaultdict(lambda: [0, 0.0])
for e in tr["traceEvents"]:
    if e.get("cat") == "kernel":
        k = (e["name"][:60], str(e.get("args", {}).get("grid")))
        agg[k][0] += 1
        agg[k][1] += e["dur"] / 1e3
tot = sum(v[1] for v in agg.values())
print(f"total kernel ms {tot:.1f}")
for (n, g), (c, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:45]:
    print(f"{ms:8.2f} ms {c:5d}x  {n}  grid={g}")
os.remove(path)

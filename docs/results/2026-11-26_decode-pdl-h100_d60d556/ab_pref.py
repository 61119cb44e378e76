"""PDL on; weight-panel L2 prefetch before the wait, WB_PREF columns (0 = none), alternating; bits compared."""
import os
import statistics
import sys

import torch

sys.path.insert(0, "bench")
from timing import in_mode  # noqa: E402

from workbench.generation import SamplingParams, generate  # noqa: E402
from workbench.models import build  # noqa: E402

model = build("qwen3-1.7B", device="cuda", dtype=torch.bfloat16, seed=0)
params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
prefs = sys.argv[1:] or ["0", "512", "2048"]
for batch in (64, 256):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, 128), generator=g).tolist()
    res = {}
    with in_mode("invariant"):
        for rnd in range(2):
            for p in prefs:
                os.environ["WB_PREF"] = p
                generate(model, prompts, SamplingParams(max_new_tokens=4))
                outs = [generate(model, prompts, params) for _ in range(3)]
                r = res.setdefault(p, {"step": [], "out": outs[0]})
                r["step"] += [o.decode_s / max(o.steps - 1, 1) * 1e3 for o in outs]
    base = res["0"]["out"]
    for p, r in res.items():
        same = all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
                   for a, b in zip(r["out"].completions, base.completions))
        print(f"batch {batch} pref {p:>5}: step {statistics.median(r['step']):.3f} ms "
              f"({', '.join(f'{x:.2f}' for x in r['step'])}) same bits {same}", flush=True)

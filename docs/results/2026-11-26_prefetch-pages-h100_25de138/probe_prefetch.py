"""Probe: the decode products' weight prefetch before the PDL wait (`matmul._PREFETCH_K`), per amount of K,
in the generator's decode step (kept graphs; each amount captured in its own graph), alternating over rounds.
Same tokens and log-probs as with none, per call; decode step ms (median over rounds)."""
import statistics
import sys

import torch

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.kernels import mode
from workbench.models import build

mm = sys.modules["workbench.kernels.matmul"]
AMOUNTS = [int(a) for a in (sys.argv[1].split(",") if len(sys.argv) > 1 else "0,256,512,1024,2048,8192".split(","))]
ROUNDS = 3
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
for shape, batches in (("qwen3-1.7B", (64, 256)), ("smollm2-135M", (64, 256))):
    model = build(shape, device="cuda", seed=0)
    for batch in batches:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, model.config.vocab_size, (batch, 128), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
        steps = {a: [] for a in AMOUNTS}
        ref, same = None, {a: True for a in AMOUNTS}
        with mode("invariant"):
            for r in range(ROUNDS):
                for a in AMOUNTS:
                    mm._PREFETCH_K = a
                    keep = DecodeGraphs()
                    generate(model, prompts, params, keep=keep)  # compile and capture with this amount
                    for _ in range(2):
                        out = generate(model, prompts, params, keep=keep)
                        steps[a].append(out.decode_s / max(out.steps - 1, 1) * 1e3)
                    if ref is None:
                        ref = out
                    same[a] &= all(x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)
                                   for x, y in zip(ref.completions, out.completions))
                    del keep
                    torch.cuda.empty_cache()
        base = statistics.median(steps[AMOUNTS[0]])
        for a in AMOUNTS:
            med = statistics.median(steps[a])
            print(f"{shape} batch {batch} prefetch {a:5d}: step {med:.3f} ms ({base / med:.3f}x of {AMOUNTS[0]}) "
                  f"[{', '.join(f'{x:.2f}' for x in steps[a])}] same bits: {same[a]}", flush=True)
    del model
    torch.cuda.empty_cache()

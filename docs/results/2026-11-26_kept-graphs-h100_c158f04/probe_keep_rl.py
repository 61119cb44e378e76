"""Probe: an RL loop's rollouts with and without kept decode graphs (`DecodeGraphs`). Each call has other prompts
(lengths 80-200, like chat-formatted GSM8K questions) and another seed, as an RL step does; 300 stop tokens end
rows at random times (random weights sample near-uniformly, ~0.6% a token), so the batch compacts as real rollouts
do. Same tokens and log-probs with and without, per call; the wall time of each call.

    python probe_keep_rl.py
"""
import statistics
import time

import torch

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.models import build

for shape, batch in (("smollm2-135M", 64), ("smollm2-135M", 256), ("qwen3-1.7B", 64)):
    model = build(shape, device="cuda", seed=0)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    stops = tuple(torch.randperm(vocab, generator=g)[:300].tolist())
    calls = []
    for i in range(6):
        lens = torch.randint(80, 201, (batch,), generator=g).tolist()
        calls.append(([torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens],
                      SamplingParams(temperature=1.0, max_new_tokens=256, stop_token_ids=stops, seed=i)))
    res = {}
    for name, keep in (("captured per call", None), ("kept", DecodeGraphs())):
        generate(model, *calls[0], keep=keep)        # compile (and, kept, capture) before the timed calls
        times, outs = [], []
        for prompts, params in calls[1:]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs.append(generate(model, prompts, params, keep=keep))
            times.append(time.perf_counter() - t)
        res[name] = (times, outs)
    same = all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
               for x, y in zip(res["kept"][1], res["captured per call"][1])
               for a, b in zip(x.completions, y.completions))
    for name, (times, outs) in res.items():
        toks = sum(o.new_tokens for o in outs)
        print(f"{shape} batch {batch}, {name}: median call {statistics.median(times) * 1e3:.0f} ms "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)}), {toks / sum(times):,.0f} new tok/s, "
              f"mean steps {statistics.mean(o.steps for o in outs):.0f}, same bits as per call: {same}", flush=True)
    del model
    torch.cuda.empty_cache()

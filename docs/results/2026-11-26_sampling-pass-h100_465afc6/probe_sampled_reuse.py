"""Probe: the decode step with `sample` reusing the raw log-probs as the sampled ones at temperature 1 without
truncation (the change) against computing them again (before), Qwen3-1.7B shape, batch 64 and 256, kept graphs,
3 rounds alternating; the same tokens and log-probs both ways."""
import statistics

import torch

import workbench.generation.generator as gen
from workbench.generation import DecodeGraphs, SamplingParams, generate, sampled_logprobs
from workbench.generation.sampling import sample as new_sample
from workbench.kernels import mode
from workbench.models import build


def old_sample(logits, params, request_ids, positions):
    tokens, raw, _ = new_sample(logits, params, request_ids, positions)
    return tokens, raw, sampled_logprobs(logits, tokens, params)


model = build("qwen3-1.7B", device="cuda", seed=0)
for batch in (64, 256):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, 128), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
    steps, outs = {"before": [], "reuse": []}, {}
    with mode("invariant"):
        for r in range(3):
            for name, fn in (("before", old_sample), ("reuse", new_sample)):
                gen.sample = fn
                keep = DecodeGraphs()
                generate(model, prompts, params, keep=keep)  # compile and capture
                for _ in range(2):
                    out = generate(model, prompts, params, keep=keep)
                    steps[name].append(out.decode_s / max(out.steps - 1, 1) * 1e3)
                outs[name] = out
                del keep
    gen.sample = new_sample
    same = all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
               and torch.equal(a.sampled_logprobs, b.sampled_logprobs)
               for a, b in zip(outs["before"].completions, outs["reuse"].completions))
    for name, xs in steps.items():
        print(f"qwen3-1.7B batch {batch} {name}: step {statistics.median(xs):.3f} ms "
              f"[{', '.join(f'{x:.2f}' for x in xs)}] same bits: {same}", flush=True)

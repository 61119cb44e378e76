"""Where a decode step's time goes (issue 16's first item): the embedded generator at the Qwen3-1.7B shape (random
weights), 128-token prompts, batch 64 and 256, invariant mode, the fast standard baseline (`standard-fused`) and
Hugging Face's eager formulas (`standard`); `--shape smollm2-135M` the regime map's model; `--fp8` the model's fp8
copy (`generation/fp8.py`, the `off-fp8` arm's sampler: run it with `--modes standard-fused`, that arm's kernels).
Per decode step:

- the step as `generate` runs it (CUDA graph replay plus the loop's bookkeeping), from its own timer, over the
  same steps;
- the GPU kernels of one step by kind (matmuls, attention, norms, RoPE, SwiGLU, sampling and log-probs, KV-cache
  writes, other), from the profiler over 255 eager decode steps (the same kernels the graph replays), minus a
  prefill-only run;
- each kind's byte floor where it has one (matmuls: every projection's and the LM head's weights read once;
  attention: each sequence's K/V read once) at the measured copy bandwidth;
- what is left: the step's time not covered by kernels, split into the graph replayed back to back alone
  (its kernels plus the gaps between its nodes) and the rest (the loop's host work and eager bookkeeping);
- the step's first call (captured, then replayed), which each `generate` call without kept graphs
  (`DecodeGraphs`) pays once;
- kernel launches per step (graph nodes plus the loop's eager ops).

    python bench/profile_decode.py [--out FILE.md] [--batches 64 256] [--modes invariant standard-fused standard]
                                    [--kernels N] [--fp8]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bench_generate import PROMPT, _prompts
from timing import MODES, copy_gbs, emit, header, in_mode

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.generation.fp8 import Fp8Sampler
from workbench.generation.generator import DecodeStep, Record
from workbench.generation.sampling import KEYED_SEED, request_keys
from workbench.models import KVCache, build
from workbench.models.decoding import DecodingModel

STEPS = 255  # 256 new tokens (bench_generate's): the first comes from the prefill
# Kernel name fragments -> kind, first match wins (Triton kernels by their function names, cuBLAS/ATen by theirs;
# FlashAttention's name holds "cutlass" too, so attention is tried first).
KINDS = (
    ("attention", ("_attn", "flash", "fmha", "attention")),
    ("matmul", ("_matmul", "_swiglu_product", "gemm", "sm90_xmma", "cutlass", "nvjet")),  # with SwiGLU folded in
    ("norm", ("_rms_norm", "rms")),
    ("rope", ("_rope",)),
    ("swiglu", ("_silu", "silu")),
    ("sampling + log-probs", ("_gumbel", "_logprob", "_lse", "_entropy", "_cumsum", "softmax", "argmax", "max",
                              "exponential", "log")),
    ("kv write, copies", ("_kv_write", "index_put", "scatter", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, parts in KINDS:
        if any(p.lower() in low for p in parts):
            return kind
    return "other"


def kernel_ms(model, prompts, mode_name: str, new_tokens: int) -> tuple[dict[str, float], dict[str, tuple]]:
    """GPU ms by kind of one eager generation of `new_tokens` tokens, and the number of launches (`launches`);
    and by kernel name, (ms, launches)."""
    with in_mode(mode_name), profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0),
                 cuda_graphs=False)
        torch.cuda.synchronize()
    out, names = defaultdict(float), {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us:
            out[kind_of(e.key)] += us / 1e3
            out["launches"] += e.count
            names[e.key] = (us / 1e3, e.count)
    return out, names


def replay_ms(model, prompts, mode_name: str) -> tuple[float, float]:
    """One decode step's CUDA graph (its bookkeeping included) replayed back to back, nothing between replays: ms
    per replay (median of 5 runs of 50, each replay a step further along the cache); and the ms of the step's
    first call, which every `generate` call without kept graphs pays once (the step captured, then replayed)."""
    cfg = model.config
    dev = model.lm_head_weight.device
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev, dtype=torch.int32)
    ids = torch.tensor([p + [0] * (PROMPT - len(p)) for p in prompts], device=dev)
    cache = KVCache.allocate(cfg, b, PROMPT + STEPS + 1, dev)
    times = []
    with in_mode(mode_name), torch.no_grad():
        decoding = DecodingModel(model)
        decoding.hidden_states(ids, lens, cache, torch.zeros_like(lens))
        rows = torch.arange(b, device=dev)
        record = Record.allocate(b, STEPS + 1, dev)
        pending = (ids[:, 0], torch.zeros(b, device=dev), torch.zeros(b, device=dev))
        never = torch.tensor([-1], device=dev)                      # no stop token: every row stays live
        step = DecodeStep(decoding, cache, SamplingParams(temperature=1.0, seed=KEYED_SEED), record, never,
                          graph=True).load(rows, request_keys(0, rows), pending, lens, 0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()                                                       # captures, then replays
        torch.cuda.synchronize()
        first = (time.perf_counter() - t) * 1e3
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                step.graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 50)
    return sorted(times)[2], first


def step_ms(model, prompts, mode_name: str) -> float:
    """The decode step as `generate` runs it (CUDA graphs), over the same steps as the profile: median of 5, the
    caches and graph kept from a first call (`DecodeGraphs`, as bench_generate.py), so no capture is in it."""
    times = []
    params, keep = SamplingParams(temperature=1.0, max_new_tokens=STEPS + 1, seed=0), DecodeGraphs()
    with in_mode(mode_name):
        generate(model, prompts, params, keep=keep)  # compile and capture
        for _ in range(5):
            out = generate(model, prompts, params, keep=keep)
            times.append(out.decode_s / (out.steps - 1) * 1e3)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--batches", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--shape", default="qwen3-1.7B", help="a named shape (workbench.models.config), random weights")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list the N kernels taking the most time per step, by name")
    ap.add_argument("--fp8", action="store_true",
                    help="profile the model's fp8 copy (the off-fp8 arm's sampler, W8A8 projections)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA GPU")
    model = build(a.shape, device="cuda", seed=0)
    if a.fp8:
        model = Fp8Sampler(model).model
    cfg = model.config
    gbs = max(copy_gbs())
    # The fp8 copy holds its projections' codes (1 byte each) as buffers named `weight`, not as parameters.
    weights = sum(p.numel() * p.element_size() for n, p in (*model.named_parameters(), *model.named_buffers())
                  if "norm" not in n and n.endswith("weight"))
    kinds = [k for k, _ in KINDS] + ["other"]
    lines = [header(), "",
             f"{a.shape} shape, random weights{' (its fp8 copy: W8A8 projections)' if a.fp8 else ''}, "
             f"{PROMPT}-token prompts; kernels per decode step = (profile of "
             f"{STEPS} eager decode steps - profile of the prefill alone) / {STEPS}, at a mean KV length of "
             f"{PROMPT + STEPS // 2}; the step as `generate` runs it (graphs, the same {STEPS} steps), median of 5. "
             "In `standard` mode norms, RoPE and SwiGLU are ATen elementwise kernels, counted under `other`. Floors "
             f"at {gbs:.0f} GB/s (measured copy).", "",
             "| mode | batch | step ms | kernels ms | not kernels ms | graph alone ms | first step ms | launches | "
             + " | ".join(f"{k} ms" for k in kinds) + " | matmul floor ms | attention floor ms |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(kinds) + "---|---|"]
    tables = []
    for batch in a.batches:
        prompts = _prompts(batch, cfg.vocab_size)
        kv = batch * (PROMPT + STEPS // 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        for mode_name in a.modes:
            kernel_ms(model, prompts, mode_name, 2)  # compile
            base, base_names = kernel_ms(model, prompts, mode_name, 1)
            run, run_names = kernel_ms(model, prompts, mode_name, STEPS + 1)
            per = {k: (run.get(k, 0.0) - base.get(k, 0.0)) / STEPS for k in kinds}
            busy = sum(per.values())
            launches = (run["launches"] - base["launches"]) / STEPS
            step = step_ms(model, prompts, mode_name)
            replay, first = replay_ms(model, prompts, mode_name)
            lines.append(f"| {mode_name} | {batch} | {step:.2f} | {busy:.2f} | {step - busy:.2f} | "
                         f"{replay:.2f} | {first:.0f} | {launches:.0f} | "
                         + " | ".join(f"{per[k]:.2f}" for k in kinds)
                         + f" | {weights / gbs / 1e6:.2f} | {kv / gbs / 1e6:.2f} |")
            print(lines[-1], flush=True)
            if a.kernels:
                tables.append(by_name(run_names, base_names, mode_name, batch, a.kernels))
    emit(lines + [line for t in tables for line in t], a.out)


def by_name(run: dict, base: dict, mode_name: str, batch: int, top: int) -> list[str]:
    """The `top` kernels by time per decode step (the run's minus the prefill's, over the steps), a table."""
    per = {k: ((ms - base.get(k, (0.0, 0))[0]) / STEPS, (n - base.get(k, (0.0, 0))[1]) / STEPS)
           for k, (ms, n) in run.items()}
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    out = ["", f"{mode_name}, batch {batch}: kernels by time per decode step", "",
           "| kernel | kind | us per step | launches per step | us per launch |", "|---|---|---|---|---|"]
    for name, (ms, n) in rows:
        out.append(f"| `{name[:90]}` | {kind_of(name)} | {ms * 1e3:.1f} | {n:.1f} | {ms * 1e3 / max(n, 1e-9):.2f} |")
    print("\n".join(out), flush=True)
    return out


if __name__ == "__main__":
    main()

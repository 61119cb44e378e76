"""Where a vLLM decode step's time goes, for the workbench model in vLLM and for vLLM's own batch-invariant Qwen3,
at the Qwen3-1.7B shape (random weights), 128-token prompts, the batch asked (256 by default), temperature 1.

Without the profiler first: vLLM's scheduler settings, the decode step's marginal cost (calls of --new and --new/4
tokens), and for the workbench model every eager forward (prefill and mixed steps; decode steps replay a graph)
and the host time of its `compute_logits`. Then one `generate` call of --new tokens under the profiler; per step:
- the wall time (the call's seconds / its steps);
- the GPU's busy time (the union of its kernels' intervals) and its idle time: a step whose GPU idles is bound by
  the host (vLLM's scheduler and sampler, eager launches), not by kernels;
- the kernels by kind (profile_decode's kinds, which name our Triton kernels and cuBLAS/FlashAttention alike),
  and the top kernels by name;
- the host: the top CPU ops by their own time, and the CUDA runtime calls (launches, synchronisations).

Each backend runs in a process of its own (vLLM reads its batch-invariant switch once per process):

    VLLM_USE_FLASHINFER_SAMPLER=0 python bench/profile_vllm.py [--backends vllm-workbench vllm-bi] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_vllm import BACKENDS, _prompts
from profile_decode import kind_of
from timing import emit, header

import torch
from torch.profiler import ProfilerActivity, profile

from workbench.generation import SamplingParams
from workbench.kernels import mode
from workbench.models import build, save_pretrained


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """The union of [start, end) intervals, in their unit."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def worker(backend: str, shape: str, batch: int, new: int) -> dict:
    from workbench.generation.vllm_backend import VLLMGenerator

    impl, bi = BACKENDS[backend]
    model = build(shape, device="cuda", dtype=torch.bfloat16, seed=0)
    folder = Path(tempfile.mkdtemp()) / "model"
    save_pretrained(model, folder)
    vocab = model.config.vocab_size
    del model
    with mode("invariant"):
        engine = VLLMGenerator(folder, gpu_memory_utilization=0.35, batch_invariant=bi, model_impl=impl)
    prompts = _prompts(batch, 128, vocab, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=1)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))   # graphs, compile
    vc = engine.llm.llm_engine.vllm_config
    setup = {"max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
             "max_num_seqs": vc.scheduler_config.max_num_seqs,
             "async_scheduling": getattr(vc.scheduler_config, "async_scheduling", None),
             "cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
             "max_capture": vc.compilation_config.max_cudagraph_capture_size}
    # Without the profiler: the call's seconds at a quarter and at all of the new tokens (the difference over the
    # steps between is the decode step's marginal cost), and (our model) every eager forward and every
    # compute_logits call with its host seconds: a step replayed from a graph never calls forward.
    calls = defaultdict(list)
    if impl == "workbench":
        m = engine.model()
        for name in ("forward", "compute_logits"):
            def timed(*args, _f=getattr(m, name), _name=name, **kw):
                t0 = time.perf_counter()
                y = _f(*args, **kw)
                x = next(t for t in (*args, *kw.values()) if isinstance(t, torch.Tensor))
                calls[_name].append((int(x.shape[0]), time.perf_counter() - t0))
                return y
            setattr(m, name, timed)
    short = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new // 4, seed=1)).decode_s
    calls.clear()
    full = engine.generate(prompts, params).decode_s
    setup.update(marginal_step_us=(full - short) / (new - new // 4) * 1e6, call_s=full,
                 eager_forwards=[(n, round(s * 1e3, 2)) for n, s in calls["forward"]],
                 logits_calls=len(calls["compute_logits"]),
                 logits_host_us=sum(s for _, s in calls["compute_logits"]) / max(1, len(calls["compute_logits"]))
                 * 1e6)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = engine.generate(prompts, params)
        torch.cuda.synchronize()
    wall_us = out.decode_s * 1e6
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    ranges = defaultdict(float)   # vLLM's own record_function ranges (model runner phases), total µs
    for e in events:
        if e.get("cat") == "user_annotation" and "dur" in e:
            ranges[e["name"]] += e["dur"]
    by_name, by_kind, api = defaultdict(lambda: [0, 0.0]), defaultdict(float), defaultdict(lambda: [0, 0.0])
    for k in kernels:
        by_name[k["name"]][0] += 1
        by_name[k["name"]][1] += k["dur"]
        by_kind[kind_of(k["name"])] += k["dur"]
    for r in runtime:
        api[r["name"]][0] += 1
        api[r["name"]][1] += r["dur"]
    # Self time of CPU ops: an op's duration minus its children's (nested on one thread).
    self_us, residual = defaultdict(lambda: [0, 0.0]), defaultdict(float)
    for tid in {e["tid"] for e in cpu_ops}:
        ops = sorted((e for e in cpu_ops if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in ops:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                residual[id(stack[-1])] -= e["dur"]
            residual[id(e)] += e["dur"]
            stack.append(e)
        for e in ops:
            self_us[e["name"]][0] += 1
            self_us[e["name"]][1] += residual[id(e)]
    return {"backend": backend, "batch": batch, "steps": new, "wall_us": wall_us,
            "busy_us": _busy_us([(k["ts"], k["ts"] + k["dur"]) for k in kernels]),
            "kernels": len(kernels), "by_kind": dict(by_kind),
            "top_kernels": sorted(((n, c, d) for n, (c, d) in by_name.items()), key=lambda x: -x[2])[:15],
            "top_cpu": sorted(((n, c, d) for n, (c, d) in self_us.items()), key=lambda x: -x[2])[:20], "setup": setup,
            "ranges": sorted(ranges.items(), key=lambda x: -x[1])[:20],
            "api": sorted(((n, c, d) for n, (c, d) in api.items()), key=lambda x: -x[2])[:8]}


def tables(rows: list[dict]) -> list[str]:
    lines = [header(), "", "Per decode step, µs (one generate call under the profiler, after a warm-up):", "",
             "| backend | batch | wall | GPU busy | GPU idle | kernels | " +
             " | ".join(sorted({k for r in rows for k in r["by_kind"]})) + " |", "|---" * (6 + len(
                 {k for r in rows for k in r["by_kind"]})) + "|"]
    kinds = sorted({k for r in rows for k in r["by_kind"]})
    for r in rows:
        n = r["steps"]
        lines.append(f"| {r['backend']} | {r['batch']} | {r['wall_us'] / n:,.0f} | {r['busy_us'] / n:,.0f} | "
                     f"{(r['wall_us'] - r['busy_us']) / n:,.0f} | {r['kernels'] / n:.0f} | "
                     + " | ".join(f"{r['by_kind'].get(k, 0) / n:,.0f}" for k in kinds) + " |")
    for r in rows:
        n = r["steps"]
        lines += ["", f"{r['backend']}: {json.dumps(r['setup'])}"]
        lines += ["", f"{r['backend']}: top kernels, calls and µs per step", ""]
        lines += [f"- {c / n:7.1f} {d / n:8,.1f}  {name[:110]}" for name, c, d in r["top_kernels"]]
        lines += ["", f"{r['backend']}: top CPU ops by own time, calls and µs per step", ""]
        lines += [f"- {c / n:7.1f} {d / n:8,.1f}  {name[:110]}" for name, c, d in r["top_cpu"]]
        lines += ["", f"{r['backend']}: profiler ranges (record_function), µs per step", ""]
        lines += [f"- {d / n:8,.1f}  {name[:110]}" for name, d in r["ranges"]]
        lines += ["", f"{r['backend']}: CUDA runtime calls per step (count, µs)", ""]
        lines += [f"- {c / n:7.1f} {d / n:8,.1f}  {name}" for name, c, d in r["api"]]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--shape", default="qwen3-1.7B")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--new", type=int, default=256, help="new tokens of the profiled call")
    p.add_argument("--backends", nargs="+", default=["vllm-workbench", "vllm-bi"], choices=list(BACKENDS))
    p.add_argument("--worker", choices=list(BACKENDS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print("RESULT", json.dumps(worker(a.worker, a.shape, a.batch, a.new)), flush=True)
        return
    rows = []
    for backend in a.backends:
        cmd = [sys.executable, __file__, "--worker", backend, "--shape", a.shape, "--batch", str(a.batch),
               "--new", str(a.new)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            sys.path)))
        got = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not got:
            print(f"--- {backend} failed:\n{out.stderr[-3000:]}", flush=True)
        rows += got
    emit(tables(rows), a.out)


if __name__ == "__main__":
    main()

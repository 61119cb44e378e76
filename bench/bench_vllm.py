"""vLLM beside the workbench on one GPU: parity with the trainer, weight sync and throughput, for
every backend in one run.

Backends (vLLM reads its batch-invariant switch once per process, so each vLLM one runs in a
worker process of its own; the embedded generator runs in this one, with no vLLM imported):
- vLLM running the workbench model (`model_impl='workbench'`, batch-invariant mode on, decode steps in full CUDA
  graphs);
- vLLM's own Qwen3, batch-invariant mode on, then off (vLLM's default);
- the embedded generator in invariant and in standard mode.

For a small random Qwen3 and the Qwen3-1.7B shape (random weights), or any checkpoint folder named in
--shapes (a real model such as the converted SmolLM2-135M-Instruct):
1. parity: each vLLM backend samples; the trainer (invariant kernels) recomputes the tokens'
   log-probs: tokens differing, max |diff|; and a request alone vs in the batch;
2. weight sync of the trainer's bf16 weights into the generator, checked by checksum: in place and
   through a checkpoint on disk, per backend;
3. throughput at the generator benchmark's shape (128-token prompts, 256 new tokens, batch 64 and
   256), and the ratio the issue's target names: embedded invariant / vLLM batch-invariant.

    VLLM_USE_FLASHINFER_SAMPLER=0 python bench/bench_vllm.py --out runs/bench_vllm.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from timing import emit, header

import torch

from workbench.generation import SamplingParams, generate, parity_summary, parity_table, trainer_logprobs
from workbench.kernels import mode
from workbench.models import ModelConfig, build, copy_weights, load_pretrained, save_pretrained, weights_checksum

SMALL = ModelConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
BACKENDS = {"vllm-workbench": ("workbench", True), "vllm-bi": ("vllm", True), "vllm-default": ("vllm", False)}
CASES = ((64, 256), (256, 256))
"""(batch, new tokens) a worker's throughput runs take unless told (--cases)."""


def _prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def _model(shape):
    """'small', a named shape with random weights, or a checkpoint folder (a real model)."""
    if Path(shape).is_dir():
        return load_pretrained(shape, dtype=torch.bfloat16, device="cuda")
    return build(SMALL if shape == "small" else shape, device="cuda", dtype=torch.bfloat16, seed=0)


def parity(engine, model, n=32, new=64):
    prompts = _prompts(n, 32, model.config.vocab_size, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=3)
    out = engine.generate(prompts, params)
    tokens = [c.tokens for c in out.completions]
    got = [c.logprobs for c in out.completions]
    with mode("invariant"):
        s = parity_summary(parity_table(got, trainer_logprobs(model, prompts, tokens), tokens))
    alone = engine.generate(prompts[:1], params)
    s["alone_equals_batch"] = (alone.completions[0].tokens == tokens[0]
                               and torch.equal(alone.completions[0].logprobs, got[0]))
    return s


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def sync(engine, model, workdir: Path):
    fresh = build(model.config, device="cuda", dtype=torch.bfloat16, seed=11)
    state = {k: v.detach() for k, v in fresh.state_dict().items()}
    rows = [("in place", engine.load_weights(state), engine.weights_checksum() == engine.expected_checksum(state))]
    save_pretrained(fresh, workdir / "sync")
    seconds = engine.load_checkpoint(workdir / "sync")
    rows.append(("through disk", seconds, engine.weights_checksum() == engine.expected_checksum(state)))
    engine.load_weights({k: v.detach() for k, v in model.state_dict().items()})
    return rows


def embedded_sync(model, workdir: Path):
    """The trainer's sync='copy' (copy_weights into the generator's model) and sync='checkpoint'."""
    gen = build(model.config, device="cuda", dtype=torch.bfloat16, seed=None)
    state = {k: v.detach() for k, v in build(model.config, device="cuda", dtype=torch.float32, seed=11)
             .state_dict().items()}
    seconds = _timed(lambda: copy_weights(state, gen))
    rows = [("in place", seconds, weights_checksum(gen.state_dict()) == weights_checksum(
        {k: v.to(torch.bfloat16) for k, v in state.items()}))]
    # Through disk, as for vLLM: the trainer's write is not timed, the generator's read is.
    save_pretrained(gen, workdir / "esync")
    held = {}
    seconds = _timed(lambda: held.update(m=load_pretrained(workdir / "esync", dtype=torch.bfloat16, device="cuda")))
    rows.append(("through disk", seconds, weights_checksum(held["m"].state_dict()) == weights_checksum(
        gen.state_dict())))
    return rows


def throughput(generate_fn, vocab, batch, new=256):
    """New tokens/s, the median of 3 runs: a single run has shown a third of the usual rate, for every backend
    of one process at once (bench_generate.py saw the same), so one figure is not enough."""
    prompts = _prompts(batch, 128, vocab, seed=5)
    generate_fn(prompts, SamplingParams(temperature=1.0, max_new_tokens=4))  # same batch: graphs, compile
    rates = []
    for _ in range(3):
        out = {}
        seconds = _timed(lambda out=out: out.update(o=generate_fn(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=new, seed=1))))
        rates.append(sum(len(c.tokens) for c in out["o"].completions) / seconds)
    return sorted(rates)[1]


def cases(texts: list[str]) -> list[tuple[int, int]]:
    """'64x256' -> (batch 64, 256 new tokens)."""
    try:
        return [tuple(int(x) for x in t.split("x", 1)) for t in texts]
    except ValueError:
        raise SystemExit(f"--cases takes BATCHxNEW_TOKENS items such as 64x256, got {texts}") from None


def worker(backend: str, shapes: list[str], do_throughput: bool, runs: list[tuple[int, int]],
           gpu_memory: float) -> None:
    """Runs in its own process: one vLLM backend; prints one JSON line per result."""
    from workbench.generation.vllm_backend import VLLMGenerator

    impl, bi = BACKENDS[backend]
    workdir = Path(tempfile.mkdtemp())
    for shape in shapes:
        model = _model(shape)
        folder = workdir / Path(shape).name
        save_pretrained(model, folder)
        shape = Path(shape).name
        try:
            with mode("invariant"):
                engine = VLLMGenerator(folder, gpu_memory_utilization=gpu_memory, batch_invariant=bi, model_impl=impl)
            print("RESULT", json.dumps({"kind": "parity", "backend": backend, "shape": shape,
                                        **{k: float(v) for k, v in parity(engine, model).items()}}), flush=True)
            for path, seconds, ok in sync(engine, model, workdir):
                print("RESULT", json.dumps({"kind": "sync", "backend": backend, "shape": shape, "path": path,
                                            "seconds": seconds, "ok": ok}), flush=True)
            if do_throughput and shape != "small":
                for batch, new in runs:
                    tps = throughput(engine.generate, model.config.vocab_size, batch, new)
                    print("RESULT", json.dumps({"kind": "tput", "backend": backend, "shape": shape, "batch": batch,
                                                "new": new, "tok_s": tps}), flush=True)
        except Exception:
            traceback.print_exc()
            print("RESULT", json.dumps({"kind": "error", "backend": backend, "shape": shape,
                                        "error": traceback.format_exc(limit=2)[-400:]}), flush=True)
        finally:
            engine = None
            torch.cuda.empty_cache()


def _run_worker(backend, shapes, do_throughput, timeout, runs=CASES, gpu_memory=0.35):
    cmd = [sys.executable, __file__, "--worker", backend, "--shapes", *shapes, "--throughput", str(int(do_throughput)),
           "--cases", *(f"{b}x{n}" for b, n in runs), "--gpu-memory", str(gpu_memory)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    timed_out = False
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        text, err = out.stdout, out.stderr
    except subprocess.TimeoutExpired as e:
        timed_out, text, err = True, e.stdout or "", f"timed out after {timeout} s (--timeout)"
        text = text.decode() if isinstance(text, bytes) else text
    rows = [json.loads(x[7:]) for x in text.splitlines() if x.startswith("RESULT ")]
    if not rows or timed_out:
        # A worker cut off part way has printed some results: say so, or its missing figures read as not measured.
        print(f"--- {backend}: {len(rows)} results; its log ends:\n{err[-3000:]}", flush=True)
        rows.append({"kind": "error", "backend": backend, "shape": "-", "error": err[-300:]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--shapes", nargs="+", default=["small", "qwen3-1.7B"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--throughput", type=int, default=1)
    p.add_argument("--embedded", type=int, default=1, help="also measure the embedded generator")
    p.add_argument("--worker", choices=list(BACKENDS), help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=300, help="seconds per vLLM worker")
    p.add_argument("--cases", nargs="+", default=[f"{b}x{n}" for b, n in CASES], help=argparse.SUPPRESS)
    p.add_argument("--gpu-memory", type=float, default=0.35, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a.worker, a.shapes, bool(a.throughput), cases(a.cases), a.gpu_memory)
        return
    results = []
    for backend in a.backends:
        results += _run_worker(backend, a.shapes, bool(a.throughput), a.timeout)
    workdir = Path(tempfile.mkdtemp())
    for shape in a.shapes if a.embedded else []:
        model = _model(shape)
        shape = Path(shape).name
        for path, seconds, ok in embedded_sync(model, workdir):
            results.append({"kind": "sync", "backend": "embedded", "shape": shape, "path": path, "seconds": seconds,
                            "ok": ok})
        if a.throughput and shape != "small":
            for kernel_mode in ("invariant", "standard"):
                def gen_fn(prompts, params, kernel_mode=kernel_mode, model=model):
                    with mode(kernel_mode):
                        return generate(model, prompts, params)

                for batch in (64, 256):
                    results.append({"kind": "tput", "backend": f"embedded-{kernel_mode}", "shape": shape,
                                    "batch": batch, "tok_s": throughput(gen_fn, model.config.vocab_size, batch)})
        del model
        torch.cuda.empty_cache()
    emit(tables(results), a.out)


def tables(results: list[dict]) -> list[str]:
    lines = [header(), "", "Parity: the trainer (invariant kernels) recomputes every sampled token's log-prob.", "",
             "| backend | shape | tokens | differing | max abs diff | bitwise | request alone = in batch |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] == "parity":
            lines.append(f"| {r['backend']} | {r['shape']} | {r['tokens']:.0f} | {r['tokens_differing']:.0f} | "
                         f"{r['max_abs_diff']:.3g} | {bool(r['bitwise_identical'])} | "
                         f"{bool(r['alone_equals_batch'])} |")
        elif r["kind"] == "error":
            lines.append(f"| {r['backend']} | {r['shape']} | FAILED: {r['error']!r} | | | | |")
    lines += ["", "| backend | shape | weight sync | seconds | checksum equal |", "|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['shape']} | {r['path']} | {r['seconds']:.3f} | {r['ok']} |"
              for r in results if r["kind"] == "sync"]
    tput = {(r["shape"], r["batch"], r["backend"]): r["tok_s"] for r in results if r["kind"] == "tput"}
    names = ["vllm-workbench", "vllm-bi", "vllm-default", "embedded-invariant", "embedded-standard"]
    lines += ["", "Throughput, new tokens/s (128-token prompts, 256 new tokens, temperature 1):", "",
              "| shape | batch | " + " | ".join(names) + " | embedded-invariant / vllm-bi |",
              "|---|---|" + "---|" * (len(names) + 1)]
    for shape, batch in sorted({(s, b) for s, b, _ in tput}):
        vals = [tput.get((shape, batch, n)) for n in names]
        ratio = (vals[3] / vals[1]) if vals[3] and vals[1] else float("nan")
        lines.append(f"| {shape} | {batch} | " + " | ".join("-" if v is None else f"{v:,.0f}" for v in vals)
                     + f" | {ratio:.2f}x |")
    return lines


if __name__ == "__main__":
    main()

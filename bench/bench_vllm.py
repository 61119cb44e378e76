"""vLLM beside the workbench on one GPU: parity with the trainer, weight sync, and throughput.

For a small random Qwen3 and the Qwen3-1.7B shape (random weights), in one process:
1. vLLM generates (batch-invariant mode on or off); the trainer recomputes the same tokens with
   the workbench kernels in invariant and in standard mode: tokens differing, max |diff|.
2. vLLM's own batch invariance: request 0 alone vs inside the batch (tokens and log-probs).
3. Weight sync into the running engine (in place, and through a checkpoint on disk), checked by
   checksum, with its latency.
4. Throughput at the generator benchmark's shape (128-token prompts, 256 new tokens, batch 64 and
   256): vLLM vs the embedded generator (invariant, standard).

    VLLM_USE_FLASHINFER_SAMPLER=0 python bench/bench_vllm.py --out runs/bench_vllm.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit, header

import torch

from workbench.generation import SamplingParams, generate, parity_summary, parity_table, trainer_logprobs
from workbench.kernels import mode
from workbench.models import Qwen3Config, build, save_pretrained

SMALL = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def _prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def parity(engine, model, lines, label, n=32, new=64):
    prompts = _prompts(n, 32, model.config.vocab_size, seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=3)
    out = engine.generate(prompts, params)
    tokens = [c.tokens for c in out.completions]
    vllm_lp = [c.logprobs for c in out.completions]
    for kernel_mode in ("invariant", "standard"):
        with mode(kernel_mode):
            s = parity_summary(parity_table(vllm_lp, trainer_logprobs(model, prompts, tokens), tokens))
        lines.append(f"| {label} | trainer {kernel_mode} | {s['tokens']} | {s['tokens_differing']} | "
                     f"{s['max_abs_diff']:.3g} | {s['bitwise_identical']} |")
    alone = engine.generate(prompts[:1], params)
    same = (alone.completions[0].tokens == tokens[0]
            and torch.equal(alone.completions[0].logprobs, vllm_lp[0]))
    lines.append(f"| {label} | vLLM request 0 alone vs in batch {n} | {len(tokens[0])} | - | - | {same} |")


def sync(engine, model, lines, label, workdir):
    from workbench.generation.vllm_backend import VLLMGenerator

    fresh = build(model.config, device="cuda", dtype=torch.bfloat16, seed=11)
    state = {k: v.detach() for k, v in fresh.state_dict().items()}
    seconds = engine.load_weights(state)
    ok = engine.weights_checksum() == VLLMGenerator.expected_checksum(state, model.config.tie_word_embeddings)
    lines.append(f"| {label} | in place | {seconds:.3f} | {ok} |")
    save_pretrained(fresh, workdir / "sync")
    seconds = engine.load_checkpoint(workdir / "sync")
    ok = engine.weights_checksum() == VLLMGenerator.expected_checksum(state, model.config.tie_word_embeddings)
    lines.append(f"| {label} | through disk | {seconds:.3f} | {ok} |")
    # Back to the weights the trainer holds.
    engine.load_weights({k: v.detach() for k, v in model.state_dict().items()})


def throughput(engine, model, batch):
    prompts = _prompts(batch, 128, model.config.vocab_size, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=1)
    engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4))  # same batch: graphs, compile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    return sum(len(c.tokens) for c in out.completions) / (time.perf_counter() - t0)


def embedded_throughput(model, batch, kernel_mode):
    prompts = _prompts(batch, 128, model.config.vocab_size, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=1)
    with mode(kernel_mode):
        generate(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=4))  # same batch: compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompts, params)
        torch.cuda.synchronize()
    return sum(len(c.tokens) for c in out.completions) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--batch-invariant", type=int, default=1)
    p.add_argument("--shapes", nargs="+", default=["small", "1.7B"])
    p.add_argument("--throughput", type=int, default=1)
    p.add_argument("--enforce-eager", type=int, default=0)
    a = p.parse_args()
    from workbench.generation.vllm_backend import VLLMGenerator

    bi = bool(a.batch_invariant)
    lines = [header(), "", f"vLLM batch-invariant mode: {bi}", "",
             "| model | comparison | tokens | differing | max abs diff | bitwise |", "|---|---|---|---|---|---|"]
    sync_lines = ["", "| model | weight sync | seconds | checksum equal |", "|---|---|---|---|"]
    tput = ["", "| model | batch | vLLM tok/s | embedded invariant tok/s | embedded standard tok/s |",
            "|---|---|---|---|---|"]
    workdir = tempfile.mkdtemp()
    from pathlib import Path

    workdir = Path(workdir)
    for shape in a.shapes:
        cfg = SMALL if shape == "small" else shape
        model = build(cfg, device="cuda", dtype=torch.bfloat16, seed=0)
        ckpt = workdir / shape
        save_pretrained(model, ckpt)
        engine = None
        try:
            engine = VLLMGenerator(ckpt, gpu_memory_utilization=0.35, batch_invariant=bi,
                                   enforce_eager=bool(a.enforce_eager))
            parity(engine, model, lines, shape)
            sync(engine, model, sync_lines, shape, workdir)
            if a.throughput and shape != "small":
                for batch in (64, 256):
                    tput.append(f"| {shape} | {batch} | {throughput(engine, model, batch):,.0f} | "
                                f"{embedded_throughput(model, batch, 'invariant'):,.0f} | "
                                f"{embedded_throughput(model, batch, 'standard'):,.0f} |")
        except Exception:
            lines.append(f"| {shape} | FAILED: {traceback.format_exc(limit=3)[-600:]!r} | | | | |")
            traceback.print_exc()
        finally:
            del engine
            torch.cuda.empty_cache()
        print("\n".join(lines + sync_lines + tput), flush=True)
    emit(lines + sync_lines + tput, a.out)


if __name__ == "__main__":
    main()

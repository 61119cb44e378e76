"""GPU benchmark of LoRA against full fine-tuning at the Qwen3-1.7B shape (random weights): one GRPO update (scoring
pass + micro-batched forward/backward + AdamW, invariant kernels) at the same step size and micro-batch budget,
full fine-tuning (fp32 masters + AdamW on every weight) vs LoRA r = 16 on all seven projections (frozen bf16 base,
fp32 masters + AdamW on the adapters): update tokens/s, peak memory, their ratio; and the weight sync into a
generator that holds its own copy (sync='copy'): the adapters vs every weight, median of 20 with CUDA syncs, and
the trainer's whole adapter sync (copy + the bitwise check). Targets printed beside the figures: LoRA peak <= 0.5x
full at each micro-batch budget, the whole adapter sync <= 10 ms.

    python bench/bench_lora.py [--shape qwen3-1.7B] [--sequences 64] [--rank 16] [--out FILE.md]
        [--configs 8192 16384 16384+mlp 32768+layers]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from bench_train import _config, _timed, make_batch, make_weights, new_update
from timing import emit, header

from workbench.models import build, copy_weights
from workbench.models.lora import LoraConfig, adapter_state, copy_adapters
from workbench.rl.config import TrainConfig
from workbench.rl.sync import WeightSync
from workbench.rl.weights import TrainWeights

SEQ_LEN = 1024
PEAK_TARGET, SYNC_TARGET_MS = 0.5, 10.0


def measure_update(weights: TrainWeights, n: int, budget: int, recompute: str) -> tuple[float, float]:
    """(update tokens/s, peak GiB) of one GRPO update of n x 1,024 tokens, after a warm-up update."""
    vocab = weights.model.config.vocab_size
    new_update(weights, make_batch(8, SEQ_LEN, vocab, seed=1), "invariant", budget, recompute)  # compile, allocator
    batch = make_batch(n, SEQ_LEN, vocab, seed=n)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _, t_update = new_update(weights, batch, "invariant", budget, recompute)
    return n * SEQ_LEN / t_update, torch.cuda.max_memory_allocated() / 2**30


def measure_configs(weights: TrainWeights, n: int, configs, what: str) -> list[tuple[float, float]]:
    out = []
    for budget, recompute in configs:
        out.append(measure_update(weights, n, budget, recompute))
        print(f"{what}, {budget}+{recompute}: {out[-1][0]:,.0f} tokens/s, peak {out[-1][1]:.1f} GiB",
              flush=True)
    return out


def median_ms(fn, reps: int = 20) -> float:
    fn()  # warm-up
    return statistics.median(_timed(fn)[1] for _ in range(reps)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7B")
    ap.add_argument("--sequences", type=int, default=64, help="sequences of 1,024 tokens per step (default 64)")
    ap.add_argument("--configs", nargs="+", type=_config,
                    default=[(8192, "none"), (16384, "none"), (16384, "mlp"), (32768, "layers")],
                    help="micro-batch token budgets, +mlp or +layers for activation checkpointing (default 8192 "
                         "16384 16384+mlp 32768+layers)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank r (alpha = 2r)")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_lora.py needs a CUDA GPU")
    lora = LoraConfig(rank=a.rank, alpha=2.0 * a.rank)

    full = make_weights(a.shape)
    cfg = full.model.config
    full_runs = measure_configs(full, a.sequences, a.configs, "full fine-tuning")
    source = dict(full.model.state_dict())
    generator = build(cfg, device="cuda", dtype=torch.bfloat16, seed=None)
    full_copy_ms = median_ms(partial(copy_weights, source, generator))
    full_bytes = sum(v.numel() * v.element_size() for v in source.values())
    # LoRA on the same base: the bf16 weights full fine-tuning started from.
    start = build(cfg, device="cuda", dtype=torch.bfloat16, seed=None)
    copy_weights(source, start)
    del full, generator, source
    gc.collect()
    torch.cuda.empty_cache()

    weights = TrainWeights(start, "float32", 1e-6, "cuda", lora=lora)
    lora_runs = measure_configs(weights, a.sequences, a.configs, f"LoRA r={a.rank}")
    n_adapter = sum(p.numel() for p in weights.masters.values())
    with tempfile.TemporaryDirectory() as tmp:
        sync = WeightSync(TrainConfig(adapter="lora", lora_rank=lora.rank, lora_alpha=lora.alpha, sync="copy"),
                          weights.model, Path(tmp), "cuda")
        adapters = adapter_state(weights.model)
        adapter_copy_ms = median_ms(partial(copy_adapters, adapters, sync.generator))
        whole_sync_ms = median_ms(partial(sync, 1))
        moved = sync.moved_bytes

    sync_ok = "met" if whole_sync_ms <= SYNC_TARGET_MS else "MISSED"
    mib = moved / 2**20
    setup = (f"{a.shape} shape, random weights; one GRPO update of {a.sequences} x {SEQ_LEN} tokens (a quarter "
             "prompt), invariant kernels, at each micro-batch budget (recompute: what the backward "
             "recomputes, activation checkpointing); "
             "peak = the most GPU memory allocated during the update (resident weights and optimizer state "
             f"included). LoRA: r = {lora.rank}, alpha = {lora.alpha:g}, all seven projections, "
             f"{n_adapter / 1e6:.1f} M adapter parameters (fp32 masters + AdamW), frozen bf16 base. Sync: into a "
             "generator holding its own bf16 copy (sync='copy'), median of 20, CUDA-synchronised.")
    lines = [header(), "", setup, "",
             "| micro-batch tokens | recompute | full tokens/s | LoRA tokens/s | LoRA/full speed | full peak GiB | "
             f"LoRA peak GiB | LoRA/full peak (target <= {PEAK_TARGET}x) |",
             "|---|---|---|---|---|---|---|---|"]
    for (budget, recompute), (f_tps, f_peak), (l_tps, l_peak) in zip(a.configs, full_runs, lora_runs):
        ratio = l_peak / f_peak
        lines.append(f"| {budget:,} | {recompute} | {f_tps:,.0f} | {l_tps:,.0f} | {l_tps / f_tps:.2f}x "
                     f"| {f_peak:.1f} | {l_peak:.1f} | {ratio:.2f}x ({'met' if ratio <= PEAK_TARGET else 'MISSED'}) |")
    lines += ["", "| sync | bytes | ms |", "|---|---|---|",
              f"| every weight (copy_weights) | {full_bytes / 2**30:.2f} GiB | {full_copy_ms:.2f} |",
              f"| adapters (copy_adapters) | {mib:.1f} MiB | {adapter_copy_ms:.2f} |",
              f"| adapters, the trainer's whole sync (copy + bitwise check on the GPU) | {mib:.1f} MiB | "
              f"{whole_sync_ms:.2f} (target <= {SYNC_TARGET_MS:g}: {sync_ok}) |"]
    emit(lines, a.out)


if __name__ == "__main__":
    main()

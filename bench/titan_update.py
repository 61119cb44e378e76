"""The RL update on torchtitan's components (`trainer_backend='torchtitan'`, workbench/rl/titan_backend.py) beside the
workbench's own trainer, measured in the same run: tokens/s of one GRPO update (micro-batched forward, fused chunked
log-probs, backward, AdamW) and the peak memory, at the Qwen3-1.7B shape (random weights, fp32 masters), 512
sequences x 1,024 tokens (a quarter prompt) in 16,384-token micro-batches, invariant kernels; and their ratio.
Each backend's weights are built, warmed up on 8 sequences (GPU), measured, and freed before the other's.

    python bench/titan_update.py [--shape qwen3-1.7B] [--sequences 512] [--budget 16384] [--out FILE.md]
    torchrun --nproc-per-node 2 bench/titan_update.py --world-size 2   # FSDP2: each rank trains half the rows
    python bench/titan_update.py --tiny   # seconds on a CPU (the test's run; the numbers mean nothing)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc

import torch

from bench_train import _timed, make_batch, random_start

from workbench.distributed.data_parallel import DataParallel
from workbench.kernels import mode
from workbench.models import ModelConfig, config
from workbench.rl.config import TrainConfig
from workbench.rl.logprobs import score
from workbench.rl.losses import get_loss
from workbench.rl.trainer import train_weights
from workbench.rl.update import UpdateInputs, update

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
"""--tiny: a one-layer Qwen3 shape the CPU's Triton interpreter runs in seconds."""


def make(backend: str, shape: ModelConfig, cfg: TrainConfig, device: str, dp: DataParallel):
    """The backend's weights on a seeded random fp32 start (FSDP2 over every rank when there are several)."""
    return train_weights(random_start(shape, device), dataclasses.replace(cfg, trainer_backend=backend), device,
                         dp.process_group if dp.world_size > 1 else None)


def seconds(weights, cfg: TrainConfig, n: int, t: int, dp: DataParallel, device: str) -> float:
    """One GRPO update on this rank's n / world sequences of t tokens (the old log-probs computed first, untimed)."""
    rows = n // dp.world_size
    batch = make_batch(rows, t, weights.model.config.vocab_size, seed=n * 7 + dp.rank, device=device)
    run = dataclasses.replace(cfg, group_size=8, prompts_per_step=max(n // 8, 1), max_new_tokens=batch.mask.shape[1])
    with mode("invariant"):
        old, _ = score(weights.model, batch, cfg.optim.max_tokens_per_microbatch, 1.0)
        adv = torch.randn(rows, generator=torch.Generator().manual_seed(dp.rank)).to(device)
        inputs = UpdateInputs(adv, old, None, None)
        return _timed(lambda: update(run, get_loss("grpo"), weights, batch, inputs, 1,
                                     lambda loss: (_ for _ in ()).throw(FloatingPointError(str(loss))),
                                     dp if dp.world_size > 1 else None))[1]


def measure(shape: ModelConfig, n: int, t: int, budget: int, device: str, dp: DataParallel) -> dict[str, tuple]:
    """{backend: (update tokens/s over every rank, peak GiB of this rank or None on a CPU)}."""
    cuda = device == "cuda"
    cfg = TrainConfig(lr=1e-6, max_tokens_per_microbatch=budget, parallel="fsdp2" if dp.world_size > 1 else
                      "replicate")
    out = {}
    for backend in ("workbench", "torchtitan"):
        weights = make(backend, shape, cfg, device, dp)
        if cuda:   # warm-up: compilation, allocator
            seconds(weights, cfg, 8 * dp.world_size, t, dp, device)
            torch.cuda.reset_peak_memory_stats()
        s = dp.max([seconds(weights, cfg, n, t, dp, device)])[0]   # the slowest rank's
        out[backend] = (n * t / s, torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        del weights
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return out


def table(results: dict[str, tuple], shape: str, n: int, t: int, budget: int, world: int) -> list[str]:
    (wb_tps, wb_mem), (tt_tps, tt_mem) = results["workbench"], results["torchtitan"]

    def gib(x):
        return "-" if x is None else f"{x:.1f}"

    ratio = "-" if wb_mem is None else f"{tt_mem / wb_mem:.2f}"
    return [f"{shape}, random weights, fp32 masters, invariant kernels, {n} x {t} tokens, {budget}-token "
            f"micro-batches, {world} rank(s){' (FSDP2)' if world > 1 else ''}:", "",
            "| trainer | update tokens/s | peak GiB (rank 0) |", "|---|---|---|",
            f"| workbench | {wb_tps:,.0f} | {gib(wb_mem)} |", f"| torchtitan | {tt_tps:,.0f} | {gib(tt_mem)} |",
            f"| torchtitan / workbench | {tt_tps / wb_tps:.3f} | {ratio} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7B", help="a named shape (workbench.models.config)")
    ap.add_argument("--sequences", type=int, default=512, help="sequences in the update (over every rank)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    ap.add_argument("--world-size", type=int, default=1, help="ranks under torchrun (FSDP2 over them)")
    ap.add_argument("--tiny", action="store_true", help="a one-layer shape, 8 x 16 tokens per rank, on the CPU")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    device = "cpu" if a.tiny else "cuda"
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("titan_update.py needs a CUDA GPU (or --tiny for the CPU)")
    dp = DataParallel.join(device)
    if dp.world_size != a.world_size:
        raise SystemExit(f"--world-size {a.world_size} but {dp.world_size} process(es): launch with torchrun "
                         f"--nproc-per-node {a.world_size}")
    shape, n, t, budget = (TINY, 8 * a.world_size, 16, 64) if a.tiny else \
        (config(a.shape), a.sequences, a.tokens, a.budget)
    if n % (8 * dp.world_size):
        raise SystemExit(f"--sequences {n} must be a multiple of 8 x world size (GRPO groups of 8 on every rank)")
    lines = table(measure(shape, n, t, budget, device, dp), "tiny" if a.tiny else a.shape, n, t, budget,
                  dp.world_size)
    if dp.is_main:
        print("\n".join(lines))
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

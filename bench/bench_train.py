"""GPU benchmark of the trainer's update at real scale: the Qwen3-1.7B shape (random weights), fp32 masters and
AdamW resident, one GRPO update (the trainer's micro-batched forward, fused chunked log-probs over the completion
tokens, backward, AdamW) per row, in both kernel modes, with and without activation checkpointing, for steps up
to 512 sequences x 1,024 tokens. Each row: tokens/s of the update, MFU (6 x params x tokens/s over the GPU's
dense bf16 peak; the floor is MFU 1), peak memory; and the no-grad scoring pass (the old log-probs) beside it.
The baseline in the same run: the previous trainer's update (one forward with full [B, T, V] logits,
log-probs over the whole vocabulary, backward).

    python bench/bench_train.py [--shape qwen3-1.7B] [--out FILE.md] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import emit, header  # noqa: E402

from workbench.kernels import mode, token_logprobs  # noqa: E402
from workbench.models import build  # noqa: E402
from workbench.rl.config import TrainConfig  # noqa: E402
from workbench.rl.logprobs import score  # noqa: E402
from workbench.rl.losses import get_loss  # noqa: E402
from workbench.rl.rollout import RolloutBatch  # noqa: E402
from workbench.rl.update import UpdateInputs, update  # noqa: E402
from workbench.rl.weights import TrainWeights  # noqa: E402

# Dense bf16 tensor-core peaks (no sparsity), by device name.
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAKS.items() if k in name), float("nan"))


def make_weights(shape: str) -> TrainWeights:
    start = build(shape, device="meta", dtype=torch.float32, seed=None).to_empty(device="cuda")
    with torch.no_grad():  # random weights drawn on the GPU (the CPU draw of `build` takes minutes at this size)
        for name, p in start.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return TrainWeights(start, "float32", 1e-6, "cuda")


def make_batch(n: int, t: int, vocab: int, seed: int) -> RolloutBatch:
    """n sequences of t tokens: a quarter prompt, the rest completion, random ids."""
    g = torch.Generator().manual_seed(seed)
    p = t // 4
    ids = torch.randint(0, vocab, (n, t), generator=g)
    mask = torch.ones(n, t - p, device="cuda")
    return RolloutBatch(ids[:, :p].tolist(), ids[:, p:].tolist(), torch.zeros_like(mask), mask, pad_id=0)


def _timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def new_update(weights, batch, kernel_mode: str, budget: int, ckpt: bool) -> tuple[float, float]:
    """(seconds of the scoring pass, seconds of the update) of one GRPO step on `batch`."""
    cfg = TrainConfig(kernel_mode=kernel_mode, max_tokens_per_microbatch=budget, activation_checkpointing=ckpt,
                      group_size=8, prompts_per_step=max(len(batch) // 8, 1), max_new_tokens=batch.mask.shape[1])
    with mode(kernel_mode):
        (old, _), t_score = _timed(lambda: score(weights.model, batch, budget, 1.0))
        adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1)).cuda()
        inputs = UpdateInputs(adv, old, None, None)
        _, t_update = _timed(lambda: update(cfg, get_loss("grpo"), weights, batch, inputs, 1,
                                            lambda loss: (_ for _ in ()).throw(FloatingPointError(str(loss)))))
    return t_score, t_update


def old_update(weights, n: int, t: int, kernel_mode: str) -> float:
    """The previous trainer's update: full [B, T, V] logits in one forward, log-probs over them, backward."""
    model = weights.model
    ids = torch.randint(0, model.config.vocab_size, (n, t), device="cuda")
    lens = torch.full((n,), t, device="cuda", dtype=torch.int32)

    def step():
        with mode(kernel_mode):
            logits = model(ids, seq_lens=lens)
            logp = token_logprobs(logits, torch.roll(ids, -1, dims=1))[:, :-1]
            (-logp.mean()).backward()
        weights.step()

    return _timed(step)[1]


def profile(weights, modes) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = make_batch(16, 1024, weights.model.config.vocab_size, seed=0)
    for kernel_mode in modes:
        new_update(weights, batch, kernel_mode, 8192, False)
        with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t_score, t_update = new_update(weights, batch, kernel_mode, 8192, False)
        print(f"## {kernel_mode}: scoring {t_score:.3f} s, update {t_update:.3f} s (16 x 1,024 tokens)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7B")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="only steps up to 64 x 1,024 tokens")
    ap.add_argument("--modes", nargs="+", default=["invariant", "standard"])
    ap.add_argument("--profile", action="store_true",
                    help="instead of the table: the GPU kernels of one 16 x 1,024 update (8,192-token micro-batches) per mode, by total time")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    weights = make_weights(a.shape)
    if a.profile:
        profile(weights, a.modes)
        return
    n_params = sum(p.numel() for p in weights.masters.values())
    vocab = weights.model.config.vocab_size
    resident = torch.cuda.memory_allocated() / 2**30
    flops_per_token = 6 * n_params
    peak = peak_flops()
    lines = [header(), "", f"{a.shape} shape ({n_params / 1e9:.2f} B parameters), random weights; fp32 masters + "
             f"AdamW + bf16 model resident: {resident:.1f} GiB. Sequences of 1,024 tokens (a quarter prompt); "
             "log-probs at the completion tokens. Update = micro-batched forward + fused chunked log-probs + "
             "backward + AdamW; scoring = the no-grad pass that gives the old log-probs. MFU = 6 x params x "
             f"tokens/s / {peak / 1e12:.0f} TFLOP/s (dense bf16 peak); the floor (MFU 1) is "
             f"{peak / flops_per_token:,.0f} tokens/s.", "",
             "| mode | path | B x T | micro-batch tokens | act. ckpt | update tokens/s | MFU | scoring tokens/s "
             "| peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    sizes = [8, 64] if a.quick else [8, 64, 512]
    for kernel_mode in a.modes:
        configs = [(8192, False), (16384, False), (32768, True)]
        for budget, ckpt in configs:
            for i, n in enumerate(sizes):
                batch = make_batch(n, 1024, vocab, seed=n)
                if i == 0:
                    new_update(weights, batch, kernel_mode, budget, ckpt)   # warm-up: compilation, allocator
                torch.cuda.reset_peak_memory_stats()
                try:
                    t_score, t_update = new_update(weights, batch, kernel_mode, budget, ckpt)
                except torch.OutOfMemoryError:
                    lines.append(f"| {kernel_mode} | fused | {n} x 1024 | {budget} | {ckpt} | OOM | | | > 78 |")
                    torch.cuda.empty_cache()
                    continue
                tokens = n * 1024
                tps = tokens / t_update
                lines.append(f"| {kernel_mode} | fused | {n} x 1024 | {budget} | {'on' if ckpt else 'off'} | "
                             f"{tps:,.0f} | {tps * flops_per_token / peak:.2f} | {tokens / t_score:,.0f} | "
                             f"{torch.cuda.max_memory_allocated() / 2**30:.1f} |")
                print(lines[-1], flush=True)
                del batch
                torch.cuda.empty_cache()
        for n, t in ((8, 512), (16, 512)):
            old_update(weights, n, t, kernel_mode)
            torch.cuda.reset_peak_memory_stats()
            try:
                s = old_update(weights, n, t, kernel_mode)
                row = f"{n * t / s:,.0f} | {n * t / s * flops_per_token / peak:.2f} | | " \
                      f"{torch.cuda.max_memory_allocated() / 2**30:.1f}"
            except torch.OutOfMemoryError:
                row = "OOM | | | > 78"
            lines.append(f"| {kernel_mode} | previous (full logits) | {n} x {t} | {n * t} | off | {row} |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    emit(lines, a.out)


if __name__ == "__main__":
    main()

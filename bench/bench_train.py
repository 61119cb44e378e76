"""GPU benchmark of the trainer's update at real scale: the Qwen3-1.7B shape (random weights), fp32 masters and
AdamW resident, one GRPO update (the trainer's micro-batched forward, fused chunked log-probs over the completion
tokens, backward, AdamW) per row, in each kernel mode, with and without activation checkpointing, for steps up
to 512 sequences x 1,024 tokens. Each row: tokens/s of the update, MFU (6 x params x tokens/s over the GPU's
dense bf16 peak; the floor is MFU 1), peak memory; and the no-grad scoring pass (the old log-probs) beside it.
The baselines in the same run: `standard` (cuBLAS, SDPA's flash attention, the fused chunked log-prob, Hugging
Face's RMSNorm, RoPE and SwiGLU op for op in eager PyTorch), `standard-fused` (the same with fused row-wise
kernels, as Liger users run it), and the previous trainer's update (one forward with full [B, T, V] logits,
log-probs over the whole vocabulary, backward).

    python bench/bench_train.py [--shape qwen3-1.7B] [--out FILE.md] [--quick] [--sizes 512] [--configs 8192 16384]
    python bench/bench_train.py --shape smollm2-135M --mixed --sizes 64   # the regime's lengths: packed vs padded
    python bench/bench_train.py --breakdown   # where a micro-batch's GPU time goes, and each projection vs cuBLAS
    python bench/bench_train.py --breakdown --lm-head-rows 16384   # the same with a micro-batch's logits kept
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from unittest import mock

import torch

from timing import MODES, emit, gpu_ms, header, in_mode, peak_flops

from workbench.kernels import token_logprobs
from workbench.kernels.matmul import matmul
from workbench.models import RECOMPUTE, build
from workbench.rl.config import TrainConfig
from workbench.rl.logprobs import completion_logprobs, packs, score
from workbench.rl.losses import get_loss
from workbench.rl.rollout import RolloutBatch
from workbench.rl.update import UpdateInputs, update
from workbench.rl.weights import TrainWeights


def random_start(shape, device: str = "cuda"):
    """An fp32 model of `shape` (a name or a ModelConfig) with random weights drawn on `device`, seeded (the CPU
    draw of `build` takes minutes at the 1.7B shape)."""
    start = build(shape, device="meta", dtype=torch.float32, seed=None).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in start.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return start


def make_weights(shape: str) -> TrainWeights:
    return TrainWeights(random_start(shape), "float32", 1e-6, "cuda")


MIXED_PROMPT = 80
"""--mixed: prompt tokens per sequence (the regime's GSM8K prompts, ~80)."""


def make_batch(n: int, t: int, vocab: int, seed: int, device: str = "cuda", mixed: bool = False) -> RolloutBatch:
    """n sequences of t tokens: a quarter prompt, the rest completion, random ids. mixed: prompts of
    MIXED_PROMPT tokens and completions of up to t tokens as the regime's (a third at t, the rest uniform in
    [1, t]), which a padded micro-batch pads to its longest."""
    g = torch.Generator().manual_seed(seed)
    if not mixed:
        p = t // 4
        ids = torch.randint(0, vocab, (n, t), generator=g)
        mask = torch.ones(n, t - p, device=device)
        return RolloutBatch(ids[:, :p].tolist(), ids[:, p:].tolist(), torch.zeros_like(mask), mask, pad_id=0)
    lens = torch.randint(1, t + 1, (n,), generator=g)
    lens[torch.randperm(n, generator=g)[: n // 3]] = t
    ids = torch.randint(0, vocab, (n, MIXED_PROMPT + t), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).float().to(device)
    return RolloutBatch(ids[:, :MIXED_PROMPT].tolist(), [ids[i, MIXED_PROMPT:MIXED_PROMPT + int(c)].tolist()
                        for i, c in enumerate(lens)], torch.zeros_like(mask), mask, pad_id=0)


def real_tokens(batch: RolloutBatch) -> int:
    return sum(len(p) + len(c) for p, c in zip(batch.prompts, batch.completions))


def layout(packed: bool):
    """The trainer packs the workbench's model's micro-batches (`rl.logprobs.packs`); packed=False gives the
    right-padded micro-batches it ran before, for the comparison."""
    if packed:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for where in ("workbench.rl.update.packs", "workbench.rl.logprobs.packs"):
        stack.enter_context(mock.patch(where, lambda model: False))
    return stack


def _timed(fn):
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def new_update(weights, batch, row_mode: str, budget: int, recompute: str, packed: bool = True) -> tuple[float, float]:
    """(seconds of the scoring pass, seconds of the update) of one GRPO step on `batch`, its micro-batches packed or
    padded."""
    cfg = TrainConfig(kernel_mode=MODES[row_mode][0], max_tokens_per_microbatch=budget,
                      activation_checkpointing=recompute, group_size=8, prompts_per_step=max(len(batch) // 8, 1),
                      max_new_tokens=batch.mask.shape[1])
    with in_mode(row_mode), layout(packed):
        (old, _), t_score = _timed(lambda: score(weights.model, batch, budget, 1.0))
        adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(1)).cuda()
        inputs = UpdateInputs(adv, old, None, None)
        _, t_update = _timed(lambda: update(cfg, get_loss("grpo"), weights, batch, inputs, 1,
                                            lambda loss: (_ for _ in ()).throw(FloatingPointError(str(loss)))))
    return t_score, t_update


def old_update(weights, n: int, t: int, row_mode: str) -> float:
    """The previous trainer's update: full [B, T, V] logits in one forward, log-probs over them, backward."""
    model = weights.model
    ids = torch.randint(0, model.config.vocab_size, (n, t), device="cuda")
    lens = torch.full((n,), t, device="cuda", dtype=torch.int32)
    def step():
        with in_mode(row_mode):
            logits = model(ids, seq_lens=lens)
            logp = token_logprobs(logits, torch.roll(ids, -1, dims=1))[:, :-1]
            (-logp.mean()).backward()
        weights.step()

    return _timed(step)[1]


def _busy_ms(prof) -> tuple[float, float, int]:
    """(ms the GPU ran any kernel, ms from the first kernel's start to the last one's end, kernels) of a trace."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, start, end = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    return (busy + end - start) / 1e3, (spans[-1][1] - spans[0][0]) / 1e3, len(spans)


def forward_backward(weights, batch, budget: int) -> None:
    """The update's forward and backward over `batch` (no optimizer step, no host sync between micro-batches), in
    the trainer's micro-batch layout."""
    weights.zero_grad()
    for mb in batch.micro_batches(None, budget, packs(weights.model)):
        logp, _ = completion_logprobs(weights.model, mb, 1.0)
        (-(logp * batch.mask[mb.index, :mb.width]).sum() / batch.mask.sum()).backward()


def breakdown(weights, modes) -> None:
    """Where one 16 x 1,024-token micro-batch's forward and backward spend their time: the GPU's busy fraction
    (a host that cannot keep up leaves gaps), the kernels by total time, and each projection shape's three
    products (forward, d(input), d(weight)) at 16,384 rows, ours vs cuBLAS, timed alone in CUDA graphs."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    batch = make_batch(16, 1024, weights.model.config.vocab_size, seed=0)
    for row_mode in modes:
        for budget in (16384, 8192):
            with in_mode(row_mode):
                try:
                    forward_backward(weights, batch, budget)
                    t = _timed(lambda b=budget: forward_backward(weights, batch, b))[1]
                    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                        forward_backward(weights, batch, budget)
                        torch.cuda.synchronize()
                except torch.OutOfMemoryError:
                    print(f"## {row_mode}, {budget}-token micro-batches: OOM")
                    weights.zero_grad()
                    torch.cuda.empty_cache()
                    continue
            weights.zero_grad()
            busy, span, n = _busy_ms(prof)
            print(f"## {row_mode}, {budget}-token micro-batches: forward + backward {t * 1e3:.1f} ms "
                  f"({16 * 1024 / t:,.0f} tokens/s); GPU busy {busy:.1f} of {span:.1f} ms ({busy / span:.0%}), "
                  f"{n} kernels\n")
            print("| kernel | launches | GPU ms |\n|---|---|---|")
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
                print(f"| `{e.key[:90]}` | {e.count} | {e.device_time_total / 1e3:.1f} |")
            print()
    cfg = weights.model.config
    h, q, kv, i = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    m = 16384
    print("| projection | N x K | pass | ours ms | cuBLAS ms | ours TFLOP/s | ours / cuBLAS |\n|---|---|---|---|---|---|---|")
    for name, (n, k) in {"q_proj": (q, h), "k_proj, v_proj": (kv, h), "o_proj": (h, q),
                         "gate_proj, up_proj": (i, h), "down_proj": (h, i), "q, k, v fused": (q + 2 * kv, h)}.items():
        for kind in ("forward", "d(input)", "d(weight)"):
            ms = []
            for ours in (True, False):
                def make(kind=kind, ours=ours, n=n, k=k):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
                    a, b = {"forward": (x, w.t()), "d(input)": (dy, w), "d(weight)": (dy.t(), x)}[kind]
                    return (lambda: matmul(a, b)) if ours else (lambda: a @ b)
                ms.append(gpu_ms(make, 2 * (m * k + n * k + m * n), reps=10))
            print(f"| {name} | {n} x {k} | {kind} | {ms[0]:.3f} | {ms[1]:.3f} | "
                  f"{2 * m * n * k / ms[0] / 1e9:.0f} | {ms[0] / ms[1]:.2f} |", flush=True)


def _config(text: str) -> tuple[int, str]:
    """'16384', '16384+mlp' or '32768+layers' -> (token budget, what the backward recomputes); '+ckpt' is the
    earlier name of '+layers' (the older records' commands, docs/results)."""
    budget, _, what = text.partition("+")
    what = {"": "none", "ckpt": "layers"}.get(what, what)
    if not budget.isdigit() or int(budget) < 1 or what not in RECOMPUTE:
        raise argparse.ArgumentTypeError(f"{text!r}: a token budget (a positive integer), optionally +mlp or "
                                         "+layers (activation checkpointing)")
    return int(budget), what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-1.7B")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    ap.add_argument("--quick", action="store_true", help="only steps up to 64 x 1,024 tokens")
    ap.add_argument("--sizes", nargs="+", type=int, help="sequences per step (default 8 64 512; --quick: 8 64)")
    ap.add_argument("--configs", nargs="+", type=_config, default=[(8192, "none"), (16384, "none"), (32768, "layers")],
                    help="micro-batch token budgets, +mlp or +layers for activation checkpointing (e.g. 8192 "
                         "16384+mlp 32768+layers)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--mixed", action="store_true",
                    help=f"the regime's lengths: prompts of {MIXED_PROMPT} tokens, completions a third at 1,024, the "
                         "rest uniform in [1, 1,024]; tokens/s counts real tokens")
    ap.add_argument("--layouts", nargs="+", choices=["packed", "padded"],
                    help="micro-batch layouts (default: packed, the trainer's; with --mixed packed and padded)")
    ap.add_argument("--breakdown", action="store_true",
                    help="instead of the table: GPU busy fraction and kernels of one 16 x 1,024 micro-batch's forward "
                         "and backward per mode, and each projection's products vs cuBLAS")
    ap.add_argument("--lm-head-rows", type=int, metavar="N",
                    help="rows of the fused LM head + log-probs a chunk (default: the package's); a micro-batch's "
                         "token budget keeps all its logits for the backward, which then recomputes none")
    a = ap.parse_args()
    if a.lm_head_rows is not None and a.lm_head_rows < 1:
        raise SystemExit(f"bench_train.py: --lm-head-rows must be a positive number of rows, got {a.lm_head_rows}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_train.py needs a CUDA GPU")
    if a.lm_head_rows:
        # The package sizes the chunk by the machine alone (`linear_logprobs._default_chunk_rows`); the experiment
        # sets it for this process before the first update.
        # (`workbench.kernels.linear_logprobs` as an attribute is the function the package re-exports.)
        importlib.import_module("workbench.kernels.linear_logprobs")._CHUNK_ROWS_GPU = a.lm_head_rows
        print(f"The fused LM head + log-probs in chunks of {a.lm_head_rows:,} rows.\n")
    weights = make_weights(a.shape)
    if a.breakdown:
        breakdown(weights, a.modes)
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
             "| mode | path | B x T | micro-batch tokens | recompute | update tokens/s | MFU | scoring tokens/s "
             "| peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    sizes = a.sizes or ([8, 64] if a.quick else [8, 64, 512])
    layouts = a.layouts or (["packed", "padded"] if a.mixed else ["packed"])
    if a.mixed:
        lines[2] += (f" --mixed: prompts of {MIXED_PROMPT} tokens, completions a third at 1,024 and the rest uniform "
                     "in [1, 1,024] (B x T gives the longest); tokens/s counts real tokens, not padding.")
    for kernel_mode in a.modes:
        for budget, recompute in a.configs:
            for lay in layouts:
                try:  # warm-up: compilation, allocator
                    new_update(weights, make_batch(8, 1024, vocab, seed=1, mixed=a.mixed), kernel_mode, budget,
                               recompute, lay == "packed")
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                for n in sizes:
                    batch = make_batch(n, 1024, vocab, seed=n, mixed=a.mixed)
                    torch.cuda.reset_peak_memory_stats()
                    path, shape = f"fused, {lay}", f"{n} x {1024 + (MIXED_PROMPT if a.mixed else 0)}"
                    try:
                        t_score, t_update = new_update(weights, batch, kernel_mode, budget, recompute, lay == "packed")
                    except torch.OutOfMemoryError:
                        lines.append(f"| {kernel_mode} | {path} | {shape} | {budget} | {recompute} | OOM | | | > 78 |")
                        torch.cuda.empty_cache()
                        continue
                    tokens = real_tokens(batch)
                    tps = tokens / t_update
                    lines.append(f"| {kernel_mode} | {path} | {shape} | {budget} | {recompute} | "
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

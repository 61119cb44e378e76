"""Generator vs trainer: the trainer's recomputation of the sampled tokens' log-probs, and a report.

`trainer_logprobs` runs the model's full-sequence forward over prompt +
completion, batched and right-padded exactly as a trainer would, and returns
the log-prob of every completion token. In `invariant` mode it equals the
generator's log-probs bit for bit; in `standard` mode the report measures by
how much they differ.

`parity_triangle` adds the third corner: the generator's prefill path (the
whole sequence through the KV cache at once), so decode = prefill = trainer
can be checked pair by pair.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import bf16
from ..kernels import token_logprobs
from ..models import KVCache, CausalLM
from ..models.decoding import DecodingModel
from .generator import generate
from .sampling import SamplingParams, sampled_logprobs


@torch.no_grad()
def trainer_logprobs(model: CausalLM, prompts: list[list[int]], completions: list[list[int]],
                     params: SamplingParams | None = None, path: str = "train") -> list[torch.Tensor]:
    """fp32 log-probs of each completion token from one batched forward over prompt + completion.

    With `params`, of the tempered, truncated distribution sampled from (`Completion.sampled_logprobs`);
    without, of the model's own distribution (`Completion.logprobs`). `path` 'train' is the training
    forward; 'prefill' runs the same batch through a fresh KV cache on the generator's view of the model
    (`DecodingModel`), as the generator's prefill does.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"trainer_logprobs: {len(prompts)} prompts but {len(completions)} completions")
    if path not in ("train", "prefill"):
        raise ValueError(f"path must be 'train' or 'prefill', got {path!r}")
    dev = model.lm_head_weight.device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    lens = torch.tensor([len(s) for s in seqs], device=dev, dtype=torch.int32)
    ids = torch.zeros((len(seqs), int(lens.max())), device=dev, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=dev)
    if path == "train":
        logits = model(ids, seq_lens=lens)                          # [B, T, V]
    else:
        cache = KVCache.allocate(model.config, len(seqs), ids.shape[1], dev, model.lm_head_weight.dtype)
        logits = DecodingModel(model)(ids, lens, cache, torch.zeros_like(lens))
    # The token at t + 1 is scored by the logits at t.
    targets = torch.roll(ids, -1, dims=1)
    lp = token_logprobs(logits, targets) if params is None else sampled_logprobs(logits, targets, params)
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        out.append(lp[i, len(p) - 1 : len(p) - 1 + len(c)].cpu())
    return out


def parity_table(generator: list[torch.Tensor], trainer: list[torch.Tensor],
                 tokens: list[list[int]]) -> pd.DataFrame:
    """One row per generated token: both log-probs, their bits, the difference, and whether they are equal."""
    rows = []
    for s, (g, t, toks) in enumerate(zip(generator, trainer, tokens)):
        if g.shape != t.shape:
            raise ValueError(f"sequence {s}: generator has {g.numel()} log-probs, trainer {t.numel()}")
        ulps = bf16.ulp_distance(g, t)
        for i, (gv, tv, hg, ht, u) in enumerate(zip(g.tolist(), t.tolist(), bf16.to_hex(g), bf16.to_hex(t),
                                                     ulps.tolist())):
            rows.append({"seq": s, "pos": i, "token": toks[i], "generator": gv, "trainer": tv,
                         "generator_hex": hg, "trainer_hex": ht, "diff": gv - tv, "ulps": u,
                         "equal": hg == ht})
    return pd.DataFrame(rows)


def parity_summary(table: pd.DataFrame) -> dict:
    """Bitwise verdict and mismatch statistics; `kl` is the k1 estimate of KL(sampler || trainer)."""
    diff = table["diff"].abs()
    return {
        "bitwise_identical": bool(table["equal"].all()),
        "tokens": int(len(table)),
        "tokens_differing": int((~table["equal"]).sum()),
        "max_abs_diff": float(diff.max()) if len(table) else 0.0,
        "mean_abs_diff": float(diff.mean()) if len(table) else 0.0,
        "kl": float(table["diff"].mean()) if len(table) else 0.0,
    }


def format_report(table: pd.DataFrame, n: int = 20) -> str:
    """The first n tokens side by side (decimal and fp32 hex), a mark per token, and the summary line."""
    lines = [f"{'seq':>3} {'pos':>4} {'token':>7} {'generator':>14} {'hex':>8} {'trainer':>14} {'hex':>8} "
             f"{'diff':>10}  "]
    for r in table.head(n).itertuples():
        mark = "ok" if r.equal else "DIFF"
        lines.append(f"{r.seq:>3} {r.pos:>4} {r.token:>7} {r.generator:>14.8f} {r.generator_hex:>8} "
                     f"{r.trainer:>14.8f} {r.trainer_hex:>8} {r.diff:>10.2e}  {mark}")
    s = parity_summary(table)
    lines.append(f"bitwise identical: {s['bitwise_identical']}, different tokens {s['tokens_differing']} / "
                 f"{s['tokens']}, max |diff| {s['max_abs_diff']:.3g}, mean |diff| {s['mean_abs_diff']:.3g}, "
                 f"KL(sampler||trainer) ~ {s['kl']:.3g}")
    return "\n".join(lines)


PATHS = ("decode", "prefill", "train")


def random_prompts(n: int, vocab_size: int, min_len: int = 4, max_len: int = 24, seed: int = 0) -> list[list[int]]:
    """n prompts of random token ids and random lengths in [min_len, max_len] (a ragged batch)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (t,), generator=g).tolist() for t in lens]


def as_parity_table(triangle: pd.DataFrame, a: str = "decode", b: str = "train") -> pd.DataFrame:
    """Two corners of a `parity_triangle` table in `parity_table`'s layout (for `format_report`)."""
    out = pd.DataFrame({"seq": triangle.seq, "pos": triangle.pos, "token": triangle.token,
                        "generator": triangle[a], "trainer": triangle[b],
                        "generator_hex": triangle[f"{a}_hex"], "trainer_hex": triangle[f"{b}_hex"]})
    out["diff"] = out.generator - out.trainer
    out["ulps"] = bf16.ulp_distance(torch.tensor(out.generator.to_numpy(), dtype=torch.float32),
                                    torch.tensor(out.trainer.to_numpy(), dtype=torch.float32)).tolist()
    out["equal"] = out.generator_hex == out.trainer_hex
    return out


def parity_triangle(model: CausalLM, prompts: list[list[int]], params: SamplingParams,
                    request_ids: list[int] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Generate, then score the same tokens by the prefill path and by the training forward.

    Returns (per-token table with the three model log-probs and their hex, per-pair summary:
    pair, tokens, tokens differing, max |diff|, bitwise identical).
    """
    gen = generate(model, prompts, params, request_ids=request_ids)
    completions = [c.tokens for c in gen.completions]
    by_path = {"decode": [c.logprobs for c in gen.completions],
               "prefill": trainer_logprobs(model, prompts, completions, path="prefill"),
               "train": trainer_logprobs(model, prompts, completions, path="train")}
    rows = []
    for s, toks in enumerate(completions):
        for i, token in enumerate(toks):
            row = {"seq": s, "pos": i, "token": token}
            for name in PATHS:
                value = by_path[name][s][i : i + 1]
                row[name] = float(value)
                row[f"{name}_hex"] = bf16.to_hex(value)[0]
            rows.append(row)
    table = pd.DataFrame(rows)
    pairs = []
    for a, b in (("decode", "prefill"), ("prefill", "train"), ("decode", "train")):
        equal = table[f"{a}_hex"] == table[f"{b}_hex"] if len(table) else pd.Series(dtype=bool)
        diff = (table[a] - table[b]).abs() if len(table) else pd.Series(dtype=float)
        pairs.append({"pair": f"{a} vs {b}", "tokens": len(table), "tokens_differing": int((~equal).sum()),
                      "max_abs_diff": float(diff.max()) if len(table) else 0.0,
                      "bitwise_identical": bool(equal.all())})
    return table, pd.DataFrame(pairs)

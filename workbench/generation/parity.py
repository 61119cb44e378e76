"""Generator vs trainer: the trainer's recomputation of the sampled tokens' log-probs, and a report.

`trainer_logprobs` runs the model's full-sequence forward over prompt +
completion, batched and right-padded exactly as a trainer would, and returns
the log-prob of every completion token. In `invariant` mode it equals the
generator's log-probs bit for bit; in `standard` mode the report measures by
how much they differ.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import bf16
from ..kernels import token_logprobs
from ..models import Qwen3ForCausalLM
from .sampling import SamplingParams, sampled_logprobs


@torch.no_grad()
def trainer_logprobs(model: Qwen3ForCausalLM, prompts: list[list[int]], completions: list[list[int]],
                     params: SamplingParams | None = None) -> list[torch.Tensor]:
    """fp32 log-probs of each completion token from one batched forward over prompt + completion.

    With `params`, of the tempered, truncated distribution sampled from (`Completion.sampled_logprobs`);
    without, of the model's own distribution (`Completion.logprobs`).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"trainer_logprobs: {len(prompts)} prompts but {len(completions)} completions")
    dev = model.lm_head_weight.device
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    lens = torch.tensor([len(s) for s in seqs], device=dev, dtype=torch.int32)
    ids = torch.zeros((len(seqs), int(lens.max())), device=dev, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, device=dev)
    logits = model(ids, seq_lens=lens)                              # [B, T, V]
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

"""Generator vs trainer on a real checkpoint: the parity triangle (decode, prefill, training forward) in
`invariant` mode, and the mismatch the usual kernels make in `standard` mode, on chat-formatted GSM8K
prompts (ragged lengths), sampled at temperature 1 with no stop token so every sequence has `--tokens`.

Besides tokens differing and max/mean |difference| per token, it reports what the mismatch does to a
PPO step whose old log-probs are the sampler's (as the vLLM + TorchTitan blog's trainer takes them):
the per-sequence log-ratio |sum(trainer - sampler)| and how many sequences fall outside the clip
range [1/1.2, 1.2] on a step where the ratio should be exactly 1.

    python bench/bench_parity.py --model FOLDER [--prompts 64] [--tokens 128] [--data test.jsonl] [--out F.md]
        [--modes invariant standard] [--device cuda]   (on a CPU: TRITON_INTERPRET=1, and expect minutes)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from timing import emit, header

from workbench.env import resolve_device
from workbench.generation import SamplingParams
from workbench.generation.parity import parity_triangle
from workbench.kernels import mode
from workbench.models import encode_prompt, load_pretrained, load_tokenizer
from workbench.tasks import PROMPT_TEMPLATE

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def prompts(tok, data: Path, n: int) -> list[list[int]]:
    """The first n GSM8K test questions in the GSM8K task's wording, through the chat template."""
    with open(data) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n), f)]
    if len(questions) < n:
        raise SystemExit(f"{data} holds {len(questions)} questions, fewer than --prompts {n}")
    return [encode_prompt(tok, PROMPT_TEMPLATE.format(question=q)) for q in questions]


def sequence_stats(table) -> dict:
    """Per-sequence log-ratio (trainer - sampler, summed over the sequence) and the PPO clip range."""
    log_ratio = (table["train"] - table["decode"]).groupby(table["seq"]).sum()
    outside = ((log_ratio < -math.log(1.2)) | (log_ratio > math.log(1.2))).sum()
    return {"mean_abs_seq_log_ratio": float(log_ratio.abs().mean()), "seqs_outside_clip": int(outside),
            "seqs": int(len(log_ratio))}


def run(model, ids, tokens: int, mode_name: str) -> list[dict]:
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=0)
    with mode(mode_name), torch.no_grad():
        table, pairs = parity_triangle(model, ids, params)
    seq = sequence_stats(table)
    diff = (table["decode"] - table["train"])
    rows = []
    for p in pairs.to_dict("records"):
        rows.append({"mode": mode_name, **p})
    rows[-1].update(mean_abs_diff=float(diff.abs().mean()), p99=float(diff.abs().quantile(0.99)),
                    kl=float(diff.mean()), **seq)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a checkpoint folder (e.g. what fetch-model printed)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="GSM8K JSONL with a 'question' field")
    ap.add_argument("--modes", nargs="+", default=["invariant", "standard"], choices=["invariant", "standard"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    a = ap.parse_args()
    device = resolve_device(a.device)
    model = load_pretrained(a.model, dtype=torch.bfloat16, device=device)
    tok = load_tokenizer(a.model)
    ids = prompts(tok, a.data, a.prompts)
    lens = sorted(map(len, ids))
    rows = [r for m in a.modes for r in run(model, ids, a.tokens, m)]
    lines = [header(), "", f"Model {a.model}: {a.prompts} prompts of {lens[0]}-{lens[-1]} tokens (chat template), "
             f"{a.tokens} sampled tokens each (temperature 1, no stop), device {device}.", "",
             "| mode | pair | tokens | differing | max abs diff | mean abs diff | p99 | KL(sampler, trainer) | "
             "mean abs seq log-ratio | seqs outside [1/1.2, 1.2] |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        extra = (f"{r['mean_abs_diff']:.3g} | {r['p99']:.3g} | {r['kl']:.2g} | {r['mean_abs_seq_log_ratio']:.3g} | "
                 f"{r['seqs_outside_clip']} / {r['seqs']}") if "kl" in r else " | ".join([""] * 5)
        lines.append(f"| {r['mode']} | {r['pair']} | {r['tokens']} | {r['tokens_differing']} | "
                     f"{r['max_abs_diff']:.3g} | {extra} |")
    emit(lines, a.out)
    inv = [r for r in rows if r["mode"] == "invariant"]
    if any(r["tokens_differing"] for r in inv):
        raise SystemExit("invariant mode: generator and trainer differ (see the table)")


if __name__ == "__main__":
    main()

"""The workbench model on a real checkpoint against the reference implementation (transformers), and what
the model says: a report in markdown.

1. Logits over prompts of >= 64 tokens (a GSM8K question and its reference solution, chat-formatted): the
   workbench model vs transformers' `AutoModelForCausalLM` on the same weights, per dtype and kernel mode:
   max |logit difference| and top-1 agreement over every position.
2. Greedy generation: ours vs transformers' `generate(do_sample=False)` on the questions alone; equal, or
   the first divergence with both models' top-2 logit gap there (a near-tie explains a flip).
3. Sample completions (greedy, chat template) on GSM8K and arithmetic questions.

    python scripts/check_real_model.py --model smollm2-135m-instruct [--device cpu] [--dtypes fp32 bf16]
        [--modes invariant standard] [--greedy-modes standard] [--prompts 8] [--out report.md]

On a CPU the invariant kernels run in Triton's interpreter (a forward of the 135M model takes seconds per
token row block): pick the modes and sizes to fit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from workbench.env import resolve_device
from workbench.generation import SamplingParams, generate
from workbench.kernels import mode
from workbench.models import encode_prompt, load_pretrained, load_tokenizer
from workbench.models.hub import resolve_model
from workbench.tasks import PROMPT_TEMPLATE, make_task

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def _rows(n: int, data: Path) -> list[dict]:
    with open(data) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def long_prompts(tok, rows: list[dict], max_len: int) -> torch.Tensor:
    """[n, T] ids: question and reference solution as a chat exchange, cut to the shortest (>= 64) length."""
    seqs = []
    for r in rows:
        chat = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        ids = tok.apply_chat_template(chat, tokenize=True)
        seqs.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    t = min(max_len, *map(len, seqs))
    if t < 64:
        raise SystemExit(f"the prompts are only {t} tokens long; the comparison wants >= 64")
    return torch.tensor([s[:t] for s in seqs])


def _shared_prefix(ids: torch.Tensor) -> int:
    """Positions every prompt shares (the chat template's system turn): counted once, in the first row only."""
    same = (ids == ids[:1]).all(0)
    return int(same.int().cumprod(0).sum())


def logits_table(folder: Path, ids: torch.Tensor, device: str, dtypes, modes) -> list[str]:
    """Per dtype and kernel mode: max |logit difference| to transformers in the same dtype, and top-1
    agreement with it and with transformers in fp32 (the truth both bf16 models approximate). A row for
    transformers itself shows how often bf16 rounding alone flips the top-1 token."""
    import transformers

    lines = ["| dtype | model | kernels | positions | max abs logit diff vs transformers (same dtype) | top-1 = "
             "transformers (same dtype) | top-1 = transformers fp32 | seconds |", "|---|---|---|---|---|---|---|---|"]
    x = ids.to(device)
    skip = _shared_prefix(ids)
    keep = torch.ones(ids.shape, dtype=torch.bool, device=device)
    keep[1:, :skip] = False
    with torch.no_grad():
        truth = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
        top_truth = truth(x).logits.argmax(-1)
        del truth
        for name in dtypes:
            dtype = DTYPES[name]
            ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()(x).logits
            ref = ref.float()
            rows = [("transformers", "-", ref, 0.0)]
            ours = load_pretrained(folder, dtype=dtype, device=device)
            for m in modes:
                t0 = time.perf_counter()
                with mode(m):
                    got = ours(x).float()
                rows.append(("workbench", m, got, time.perf_counter() - t0))
            for who, m, got, secs in rows:
                diff = (got - ref).abs().max().item()
                same = ((got.argmax(-1) == ref.argmax(-1)) & keep).sum().item() / keep.sum().item()
                true = ((got.argmax(-1) == top_truth) & keep).sum().item() / keep.sum().item()
                lines.append(f"| {name} | {who} | {m} | {int(keep.sum())} | {diff:.3g} | {same:.2%} | {true:.2%} | "
                             f"{secs:.1f} |")
                print(lines[-1], flush=True)
    return lines


def _gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return (top[0] - top[1]).item()


def greedy_table(folder: Path, tok, prompts: list[list[int]], device: str, dtype, modes, new: int):
    import transformers

    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    ours = load_pretrained(folder, dtype=dtype, device=device)
    eos = tok.eos_token_id
    lines = ["| kernels | prompt | tokens | equal to transformers | first divergence (pos: ours/theirs, top-2 gaps) |",
             "|---|---|---|---|---|"]
    texts = {}
    for m in modes:
        with mode(m), torch.no_grad():
            out = generate(ours, prompts, SamplingParams(temperature=0, max_new_tokens=new, stop_token_ids=(eos,)))
        for i, (p, c) in enumerate(zip(prompts, out.completions)):
            x = torch.tensor([p], device=device)
            with torch.no_grad():
                theirs = ref_model.generate(x, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                                            pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
            mine = c.tokens
            first = next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            if first is None and len(mine) != len(theirs):
                first = min(len(mine), len(theirs))
            note = ""
            if first is not None and first < min(len(mine), len(theirs)):
                prefix = torch.tensor([p + mine[:first]], device=device)
                with torch.no_grad(), mode(m):
                    g_ours = _gap(ours(prefix)[0, -1])
                    g_ref = _gap(ref_model(prefix).logits[0, -1])
                note = f"{first}: {mine[first]} / {theirs[first]}, gaps {g_ours:.3g} / {g_ref:.3g}"
            elif first is not None:
                note = f"{first}: one stops earlier"
            lines.append(f"| {m} | {i} | {len(mine)} | {first is None} | {note} |")
            print(lines[-1], flush=True)
            texts[(m, i)] = tok.decode(mine, skip_special_tokens=True)
    return lines, texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a registry name, folder, .gguf or hub id")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--modes", nargs="*", default=["invariant", "standard"])
    ap.add_argument("--greedy-modes", nargs="*", default=["invariant", "standard"])
    ap.add_argument("--greedy-dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=96, help="longest comparison prompt (tokens)")
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--data", type=Path, default=GSM8K)
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    a = ap.parse_args()
    device = resolve_device(a.device)
    folder = resolve_model(a.model)
    tok = load_tokenizer(folder)
    rows = _rows(a.prompts, a.data)
    report = [f"# {a.model} vs transformers ({device}, torch {torch.__version__})", "",
              f"Checkpoint folder: `{folder.name}`. Command: `python scripts/check_real_model.py "
              f"{' '.join(sys.argv[1:])}`", "", "## Logits", ""]
    report += logits_table(folder, long_prompts(tok, rows, a.max_len), device, a.dtypes, a.modes)
    questions = [PROMPT_TEMPLATE.format(question=r["question"]) for r in rows[:4]]
    task = make_task("arithmetic", seed=0, difficulty=1, source="")
    questions += [f"What is {p.prompt.rstrip('=')}?" for p in task.problems(max(a.prompts - 4, 0), start=0)]
    prompts = [encode_prompt(tok, q) for q in questions]
    report += ["", f"## Greedy generation ({a.greedy_dtype}, {a.new} tokens at most, stop at EOS)", ""]
    lines, texts = greedy_table(folder, tok, prompts, device, DTYPES[a.greedy_dtype], a.greedy_modes, a.new)
    report += lines + ["", "## Sample completions (greedy, chat template)", ""]
    shown = a.greedy_modes[0]
    for i, q in enumerate(questions):
        report += [f"**Prompt {i}:** {q.strip()}", "", "```", texts[(shown, i)].strip(), "```", ""]
    text = "\n".join(report) + "\n"
    print(text)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark of the embedded generator: generated tokens/s, Qwen3-1.7B shape with random weights
(or a real checkpoint: --model FOLDER), 128-token prompts, 256 new tokens (no stop token), batch 64
and 256: invariant mode, standard mode and Hugging Face `transformers` `generate` on the same weights,
in the same run; and the decode step's time beside its memory-bandwidth floor ((weights + KV cache
bytes) / measured copy bandwidth).

    python bench/bench_generate.py [--model FOLDER] [--out FILE.md] [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from timing import copy_gbs, emit, header  # noqa: E402

from workbench.generation import SamplingParams, generate  # noqa: E402
from workbench.kernels import mode  # noqa: E402
from workbench.models import build, load_pretrained, save_pretrained  # noqa: E402

PROMPT, NEW = 128, 256


def _prompts(batch: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, PROMPT), generator=g).tolist()


def ours(model, batch: int, mode_name: str) -> tuple[float, float]:
    """(tokens/s over prefill + decode, decode ms per step) of the run of median tokens/s of 3 (a single run has
    shown a prefill 15x its usual time on an H100)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=0)
    prompts = _prompts(batch, model.config.vocab_size)
    with mode(mode_name):
        generate(model, prompts, SamplingParams(max_new_tokens=4))  # compile and capture
        runs = sorted((generate(model, prompts, params) for _ in range(3)), key=lambda o: o.tokens_per_s)
    out = runs[1]
    return out.tokens_per_s, out.decode_s / max(out.steps - 1, 1) * 1e3


def hf(model, batch: int) -> float:
    import transformers

    with tempfile.TemporaryDirectory() as d:
        save_pretrained(model, d)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(_prompts(batch, model.config.vocab_size), device="cuda")
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    hf_model.generate(ids, max_new_tokens=4, do_sample=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = hf_model.generate(ids, **kw)
    torch.cuda.synchronize()
    return (out.shape[1] - PROMPT) * batch / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers.generate (slow)")
    ap.add_argument("--model", help="a checkpoint folder (default: the Qwen3-1.7B shape, random weights)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    model = load_pretrained(a.model, device="cuda") if a.model else build("qwen3-1.7B", device="cuda", seed=0)
    cfg = model.config
    copy = max(copy_gbs())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    lines = [header(), "",
             "| batch | invariant tok/s | standard tok/s | HF generate tok/s | inv / std | inv / HF | "
             "decode step ms (inv) | bandwidth floor ms | step / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch in (64, 256):
        inv_tps, inv_ms = ours(model, batch, "invariant")
        std_tps, _ = ours(model, batch, "standard")
        hf_tps = float("nan") if a.skip_hf or batch > 64 else hf(model, batch)
        # A mid-generation step reads every weight once and each sequence's K/V (prompt + half the new tokens).
        kv = batch * (PROMPT + NEW // 2) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
        floor_ms = (weight_bytes + kv) / copy / 1e6
        lines.append(f"| {batch} | {inv_tps:,.0f} | {std_tps:,.0f} | {hf_tps:,.0f} | {inv_tps / std_tps:.2f} | "
                     f"{inv_tps / hf_tps:.1f} | {inv_ms:.2f} | {floor_ms:.2f} | {inv_ms / floor_ms:.2f} |")
    lines += ["", f"Model: {a.model or 'Qwen3-1.7B shape, random weights'}. Copy bandwidth {copy:.0f} GB/s; weights "
              f"{weight_bytes / 1e9:.2f} GB (bf16). HF generate is run at batch 64 only."]
    emit(lines, a.out)


if __name__ == "__main__":
    main()

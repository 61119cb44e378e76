"""GPU benchmark of the embedded generator: generated tokens/s, Qwen3-1.7B shape with random weights
(or a real checkpoint: --model FOLDER), 128-token prompts, 256 new tokens (no stop token), batch 64
and 256: invariant mode, the fast standard baseline (`standard-fused`: cuBLAS, FlashAttention over the
cache, fused row-wise kernels), Hugging Face's eager formulas (`standard`) and `transformers`
`generate` on the same weights, in the same run; and the decode step's time beside its
memory-bandwidth floor ((weights + KV cache bytes) / measured copy bandwidth); then the prefill alone, beside
cuBLAS + FlashAttention on the same shapes and the compute floor.
--long: long rollouts instead, batch 64 with 1,024 and 4,096 new tokens and batch 256 with 1,024 (one timed run
each, caches and graphs kept from an untimed first call), with the peak GPU memory, the static KV cache's size and
the decode attention alone at the mean length beside its floor, in both modes' kernels; with --vllm, vLLM's default
kernels at the same lengths (its worker alone on the GPU, 85% of its memory: the long caches do not fit the short
table's 35%); with --fp8, the model's fp8 copy too (`generation/fp8.py`, the `off-fp8` arm's sampler, in the
engine kernels it runs with): the three samplers of the regime map's `on`, `off` and `off-fp8` arms, each alone.
--shape: a named shape with random weights instead of the Qwen3-1.7B one (e.g. smollm2-135M, the regime map's).
--vllm: vLLM's engines too, in the same run (vLLM installed; each in a worker process of bench_vllm.py, which
also checks its parity with the trainer): its default kernels, batch-invariant mode, and vLLM running the workbench
model; then one table of every engine's tokens/s beside the rate of a decode step at the bandwidth floor.
--pdl-ab: the invariant decode step with programmatic dependent launch (`kernels.pdl`) and without
(WORKBENCH_PDL=0), alternating in one process, six calls each per batch, bits compared.

    python bench/bench_generate.py [--model FOLDER] [--out FILE.md] [--skip-hf] [--skip-prefill] [--vllm]
    python bench/bench_generate.py [--model FOLDER] [--out FILE.md] (--long [--vllm] [--fp8] | --prefill | --pdl-ab)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from timing import copy_gbs, emit, gpu_ms, header, in_mode, peak_flops

from workbench.generation import DecodeGraphs, SamplingParams, generate
from workbench.generation.fp8 import Fp8Sampler
from workbench.models import KVCache, build, load_pretrained, save_pretrained
from workbench.models.decoding import DecodingModel

PROMPT, NEW = 128, 256
LONG = ((64, 1024), (64, 4096), (256, 1024))
"""(batch, new tokens) of --long: issue 44's long generations."""
PREFILLS = ((64, PROMPT), (256, PROMPT), (16, 1024))
"""(batch, prompt tokens) of the prefill table: the decode table's two prefills and a long prompt."""


def _prompts(batch: int, vocab: int, length: int = PROMPT):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def ours(model, batch: int, mode_name: str, new: int = NEW, runs: int = 3,
         kept: bool = True) -> tuple[float, float, float]:
    """(tokens/s over prefill + decode, decode ms per step, peak GiB allocated) of the run of median tokens/s of
    `runs` (a single run has shown a prefill 15x its usual time on an H100). kept: the caches and graphs are kept
    from a first, untimed call of the same shape (`DecodeGraphs`: captured once, as vLLM captures at start-up);
    else each timed call captures its decode step again, as a call without `keep` does."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=0)
    prompts = _prompts(batch, model.config.vocab_size)
    keep = DecodeGraphs() if kept else None
    with in_mode(mode_name):
        if kept:
            generate(model, prompts, params, keep=keep)  # compile and capture, kept for the timed calls
        else:
            generate(model, prompts, SamplingParams(max_new_tokens=4))  # compile
        torch.cuda.reset_peak_memory_stats()
        outs = sorted((generate(model, prompts, params, keep=keep) for _ in range(runs)), key=lambda o: o.tokens_per_s)
    out = outs[len(outs) // 2]
    return out.tokens_per_s, out.decode_s / max(out.steps - 1, 1) * 1e3, torch.cuda.max_memory_allocated() / 2**30


def pdl_ab(model, weight_bytes: int, copy: float) -> list[str]:
    """The invariant decode step with PDL on and off, alternating (two rounds of three calls each), one process."""
    cfg = model.config
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, seed=0)
    lines = ["| batch | PDL | tok/s | decode step ms (median of 6) | each call's step ms | floor ms | step / floor | "
             "same bits as PDL off |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in (64, 256):
        prompts = _prompts(batch, cfg.vocab_size)
        floor_ms = (weight_bytes + kv_bytes(cfg, batch, PROMPT + NEW // 2)) / copy / 1e6
        runs = {"on": [], "off": []}
        with in_mode("invariant"):
            for _ in range(2):
                for pdl in ("on", "off"):
                    os.environ["WORKBENCH_PDL"] = "1" if pdl == "on" else "0"
                    generate(model, prompts, SamplingParams(max_new_tokens=4))
                    runs[pdl] += [generate(model, prompts, params) for _ in range(3)]
        os.environ.pop("WORKBENCH_PDL")
        same = all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
                   for a, b in zip(runs["on"][0].completions, runs["off"][0].completions))
        for pdl, outs in runs.items():
            steps = [o.decode_s / max(o.steps - 1, 1) * 1e3 for o in outs]
            step = statistics.median(steps)
            lines.append(f"| {batch} | {pdl} | {statistics.median(o.tokens_per_s for o in outs):,.0f} | {step:.3f} | "
                         f"{', '.join(f'{x:.2f}' for x in steps)} | {floor_ms:.2f} | {step / floor_ms:.2f} | "
                         f"{same if pdl == 'on' else '-'} |")
            print(lines[-1], flush=True)
    return lines


def vllm_engines(shape: str, runs=((64, NEW), (256, NEW)), backends=None, gpu_memory: float = 0.35,
                 timeout: int = 400) -> dict:
    """New tokens/s of vLLM's engines (bench_vllm.py's workers: 128-token prompts, temperature 1, the median of 3
    calls, as `ours`) keyed (engine, batch, new tokens), and the parity lines of each with the trainer."""
    from bench_vllm import BACKENDS, _run_worker

    tput, parity = {}, ["| engine | tokens | differing from the trainer | request alone = in batch |",
                        "|---|---|---|---|"]
    for backend in backends or BACKENDS:
        for r in _run_worker(backend, [shape], True, timeout, runs, gpu_memory):
            if r["kind"] == "tput":
                tput[(backend, r["batch"], r["new"])] = r["tok_s"]
                # As it comes: a run cut short by a time limit still shows what it measured.
                print(f"{backend}, batch {r['batch']}, {r['new']} new tokens: {r['tok_s']:,.0f} tok/s", flush=True)
            elif r["kind"] == "parity":
                parity.append(f"| {backend} | {r['tokens']:.0f} | {r['tokens_differing']:.0f} | "
                              f"{bool(r['alone_equals_batch'])} |")
            elif r["kind"] == "error":
                parity.append(f"| {backend} | FAILED: {r['error']!r} | | |")
    return {"tput": tput, "parity": parity}


def engines_table(rates: dict, floors: dict) -> list[str]:
    """Every engine's new tokens/s, and as a share of a decode step's rate at the bandwidth floor (prefill not
    counted in the floor, so 1.0 cannot be reached)."""
    lines = ["All engines in this run, new tokens/s (share of the floor's rate); the floor's rate: "
             + ", ".join(f"batch {b}: {f:,.0f}" for b, f in floors.items()), "",
             "| engine | " + " | ".join(f"batch {b}" for b in floors) + " |", "|---|" + "---|" * len(floors)]
    for engine in dict.fromkeys(e for e, _ in rates):
        lines.append(f"| {engine} | " + " | ".join(
            f"{rates[(engine, b)]:,.0f} ({rates[(engine, b)] / f:.2f})" if (engine, b) in rates else "-"
            for b, f in floors.items()) + " |")
    lines.append("")
    for b in floors:
        if ("vllm-default", b) in rates:
            inv_default = rates[("embedded invariant", b)] / rates[("vllm-default", b)]
            wb_bi = rates.get(("vllm-workbench", b), float("nan")) / rates.get(("vllm-bi", b), float("nan"))
            lines.append(f"Batch {b}: embedded invariant / vLLM default {inv_default:.2f}x; vLLM running the "
                         f"workbench model / vLLM batch-invariant {wb_bi:.2f}x.")
    return lines


def kv_bytes(cfg, batch: int, tokens: int) -> int:
    """Bytes of K and V (bf16) for `batch` sequences of `tokens` tokens."""
    return batch * tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2


def attention_ms(cfg, batch: int, kv_len: int, mode_name: str = "invariant") -> float:
    """The decode attention alone in `mode_name`'s kernel: every layer's, one query a sequence over `kv_len` cached
    keys (the static cache), the layers in one CUDA graph (`gpu_ms`: the caches far exceed the L2, so one set)."""
    from workbench.kernels import attention_with_cache

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, kv_len, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16),
               torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16))
              for _ in range(cfg.num_hidden_layers)]
    q = torch.randn(batch, 1, cfg.num_attention_heads, cfg.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
    start = (lens - 1).long()

    def layers():
        for k, v in caches:
            attention_with_cache(q, k, v, start, lens)

    with in_mode(mode_name):
        return gpu_ms(lambda: layers, kv_bytes(cfg, batch, kv_len))


def long_rollouts(model, weight_bytes: int, copy: float, vllm_rates: dict, cases=LONG,
                  fp8: bool = False) -> list[str]:
    """Issue 44's long generations (`cases`, (batch, new tokens) pairs): each step against its floor at the mean KV
    length, memory, the decode attention of both modes beside its own floor, and with vLLM's rates the target's
    ratio. fp8: the model's fp8 copy as well, in the engine kernels (the `off-fp8` arm's sampler)."""
    cfg = model.config
    samplers = [("invariant", model, "invariant"), ("standard-fused", model, "standard-fused")]
    if fp8:
        samplers.append(("standard-fused, fp8 copy", Fp8Sampler(model).model, "standard-fused"))
    lines = ["| batch | new tokens | sampler | tok/s | decode step ms | floor ms | step / floor | peak GiB | "
             "static KV cache GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    attention, ratios = ["| batch | new tokens | mean keys | invariant attention ms (every layer) | standard-fused "
                         "attention ms | their floor ms | invariant / floor | standard-fused / floor | share of the "
                         "invariant step | share of the standard-fused step |",
                         "|---|---|---|---|---|---|---|---|---|---|"], []
    for batch, new in cases:
        mean_keys = PROMPT + new // 2
        # The fp8 copy reads one byte a weight, but the floor stays the bf16 weights': the rows compare one job.
        floor_ms = (weight_bytes + kv_bytes(cfg, batch, mean_keys)) / copy / 1e6
        rate, steps = {}, {}
        for label, m, mode_name in samplers:
            rate[label], steps[label], peak = ours(m, batch, mode_name, new, runs=1)
            lines.append(f"| {batch} | {new} | {label} | {rate[label]:,.0f} | {steps[label]:.2f} | "
                         f"{floor_ms:.2f} | {steps[label] / floor_ms:.2f} | {peak:.1f} | "
                         f"{kv_bytes(cfg, batch, PROMPT + new) / 2**30:.1f} |")
            print(lines[-1], flush=True)
        torch.cuda.empty_cache()
        att = {m: attention_ms(cfg, batch, mean_keys, m) for m in ("invariant", "standard-fused")}
        att_floor = kv_bytes(cfg, batch, mean_keys) / copy / 1e6
        attention.append(f"| {batch} | {new} | {mean_keys} | {att['invariant']:.3f} | {att['standard-fused']:.3f} | "
                         f"{att_floor:.3f} | {att['invariant'] / att_floor:.2f} | "
                         f"{att['standard-fused'] / att_floor:.2f} | {att['invariant'] / steps['invariant']:.0%} | "
                         f"{att['standard-fused'] / steps['standard-fused']:.0%} |")
        print(attention[-1], flush=True)
        torch.cuda.empty_cache()
        default = vllm_rates.get(("vllm-default", batch, new))
        if default:
            inv = rate["invariant"]
            ratios.append(f"| {batch} | {new} | {inv:,.0f} | {default:,.0f} | **{inv / default:.2f}x** |")
    out = [*lines, "", "The decode attention at the mean length (the static cache's kernel of each mode, every layer "
           "in one graph; floor: the K/V bytes read at the copy bandwidth):", "", *attention]
    if ratios:
        out += ["", "Embedded invariant against vLLM's default kernels in this run (target >= 1.2x):", "",
                "| batch | new tokens | embedded invariant tok/s | vLLM default tok/s | ratio |", "|---|---|---|---|---|",
                *ratios]
    return out


def _wall_ms(call, runs: int = 5) -> float:
    """Median wall ms of `call` from an idle GPU to its end, launches included: what a generate call pays."""
    call()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[runs // 2]


def prefill(model) -> list[str]:
    """Prefill of the prompts (no sampling): the generator's (into its static cache, `new` slots beyond the prompt)
    in invariant and standard-fused mode, and cuBLAS + FlashAttention (the standard-fused forward without a cache:
    causal SDPA over the prompt) on the same shapes; against the compute floor (the decoder's matmul and causal
    attention FLOPs at the GPU's dense bf16 peak)."""
    cfg = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    lines = ["| batch x prompt | generator invariant ms | generator standard-fused ms | cuBLAS + FlashAttention ms | "
             "invariant tok/s | cuBLAS + FlashAttention tok/s | inv / cuBLAS+FA | compute floor ms | "
             "inv / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch, prompt in PREFILLS:
        ids = torch.tensor(_prompts(batch, cfg.vocab_size, prompt), device="cuda")
        lens = torch.full((batch,), prompt, device="cuda", dtype=torch.int32)
        cache = KVCache.allocate(cfg, batch, prompt + NEW, "cuda")
        ms = {}
        with torch.no_grad():
            for name in ("invariant", "standard-fused"):
                with in_mode(name):
                    decoding = DecodingModel(model)
                    ms[name] = _wall_ms(lambda: decoding.hidden_states(ids, lens, cache, torch.zeros_like(lens)))
            with in_mode("standard-fused"):
                ms["flash"] = _wall_ms(lambda: model.hidden_states(ids, seq_lens=lens))
        tokens = batch * prompt
        attn = 2 * 2 * batch * prompt * prompt / 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        floor = (2 * linear * tokens + attn) / peak_flops() * 1e3
        lines.append(f"| {batch} x {prompt} | {ms['invariant']:.1f} | {ms['standard-fused']:.1f} | {ms['flash']:.1f} | "
                     f"{tokens / ms['invariant'] * 1e3:,.0f} | {tokens / ms['flash'] * 1e3:,.0f} | "
                     f"{ms['flash'] / ms['invariant']:.2f} | {floor:.1f} | {ms['invariant'] / floor:.2f} |")
        print(lines[-1], flush=True)
    return lines


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


def _case(text: str) -> tuple[int, int]:
    try:
        batch, new = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a case is BATCHxNEW_TOKENS, e.g. 64x4096; got {text!r}") from None
    return batch, new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers.generate (slow)")
    ap.add_argument("--model", help="a checkpoint folder (default: --shape's random weights)")
    ap.add_argument("--shape", default="qwen3-1.7B", help="a named shape (workbench.models.config), random weights")
    ap.add_argument("--fp8", action="store_true", help="--long: the model's fp8 copy too (the off-fp8 arm's sampler)")
    ap.add_argument("--long", action="store_true", help="batch 64 at 1,024 and 4,096 new tokens and 256 at 1,024 "
                    "instead")
    ap.add_argument("--cases", nargs="+", type=_case, default=list(LONG), metavar="BATCHxNEW",
                    help="--long's (batch, new tokens) cases, e.g. 64x4096 (default: all three)")
    ap.add_argument("--prefill", action="store_true", help="the prefill table alone")
    ap.add_argument("--skip-prefill", action="store_true", help="leave out the prefill table")
    ap.add_argument("--pdl-ab", action="store_true", help="the invariant decode step with and without PDL instead")
    ap.add_argument("--vllm", action="store_true", help="vLLM's engines too, and the table of every engine")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py needs a CUDA GPU")
    # vLLM first, each engine in its own process, while this one holds no cache.
    vllm = {}
    if a.vllm:
        vllm = (vllm_engines(a.model or a.shape, a.cases, ["vllm-default"], gpu_memory=0.85, timeout=700) if a.long
                else vllm_engines(a.model or a.shape))
    if a.fp8 and not a.long:
        raise SystemExit("bench_generate.py: --fp8 adds the fp8 copy to --long's table; run it with --long")
    model = load_pretrained(a.model, device="cuda") if a.model else build(a.shape, device="cuda", seed=0)
    if a.prefill:
        emit([header(), "", *prefill(model)], a.out)
        return
    cfg = model.config
    copy = max(copy_gbs())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if a.pdl_ab:
        emit([header(), "", *pdl_ab(model, weight_bytes, copy), "", f"Copy bandwidth {copy:.0f} GB/s."], a.out)
        return
    if a.long:
        emit([header(), "", *long_rollouts(model, weight_bytes, copy, vllm.get("tput", {}), a.cases, a.fp8), "",
              f"Copy bandwidth {copy:.0f} GB/s; peak GiB: torch's peak allocation during the timed run, weights "
              "included.", "", *vllm.get("parity", [])], a.out)
        return
    lines = [header(), "", "Embedded modes with their caches and graphs kept from an untimed first call "
             "(`DecodeGraphs`); the invariant mode also captured per call (no `keep`).", "",
             "| batch | invariant tok/s | invariant, captured per call | standard-fused tok/s | standard tok/s | "
             "HF generate tok/s | inv / std-fused | inv / HF | decode step ms (inv) | (captured per call) | "
             "(std-fused) | bandwidth floor ms | step / floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rates = {(engine, batch): v for (engine, batch, new), v in vllm.get("tput", {}).items() if new == NEW}
    floors = {}
    for batch in (64, 256):
        inv_tps, inv_ms, _ = ours(model, batch, "invariant")
        call_tps, call_ms, _ = ours(model, batch, "invariant", kept=False)
        fused_tps, fused_ms, _ = ours(model, batch, "standard-fused")
        std_tps, _, _ = ours(model, batch, "standard")
        hf_tps = float("nan") if a.skip_hf or batch > 64 else hf(model, batch)
        # A mid-generation step reads every weight once and each sequence's K/V (prompt + half the new tokens).
        floor_ms = (weight_bytes + kv_bytes(cfg, batch, PROMPT + NEW // 2)) / copy / 1e6
        lines.append(f"| {batch} | {inv_tps:,.0f} | {call_tps:,.0f} | {fused_tps:,.0f} | {std_tps:,.0f} | "
                     f"{hf_tps:,.0f} | {inv_tps / fused_tps:.2f} | {inv_tps / hf_tps:.1f} | {inv_ms:.2f} | "
                     f"{call_ms:.2f} | {fused_ms:.2f} | {floor_ms:.2f} | {inv_ms / floor_ms:.2f} |")
        print(lines[-1], flush=True)
        rates.update({("embedded invariant", batch): inv_tps,
                      ("embedded invariant, captured per call", batch): call_tps,
                      ("embedded standard-fused", batch): fused_tps,
                      ("embedded standard", batch): std_tps})
        if hf_tps == hf_tps:
            rates[("transformers generate", batch)] = hf_tps
        floors[batch] = batch / floor_ms * 1e3
    if vllm:
        lines += ["", *engines_table(rates, floors), "", *vllm["parity"]]
    lines += ["", f"Model: {a.model or 'Qwen3-1.7B shape, random weights'}. Copy bandwidth {copy:.0f} GB/s; weights "
              f"{weight_bytes / 1e9:.2f} GB (bf16). HF generate is run at batch 64 only."]
    if not a.skip_prefill:
        lines += ["", "Prefill (wall ms, median of 5, launches included):", "", *prefill(model)]
    emit(lines, a.out)


if __name__ == "__main__":
    main()

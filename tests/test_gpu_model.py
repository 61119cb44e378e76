"""The model and attention claims on a real GPU, bitwise, at Qwen3-1.7B, SmolLM2-135M and Qwen2-0.5B shapes
(skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from workbench.kernels import attention, attention_with_cache, mode
from workbench.models import KVCache, build, config
from workbench.models.decoding import DecodingModel

pytestmark = pytest.mark.gpu

LENS = [1024, 700, 333, 1]


def _qkv(b, t, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(b, t, h, 128, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(16), mk(8), mk(8)


def _decode_positions(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return sorted({0, n - 1, *torch.randint(0, n, (24,), generator=g).tolist()})


def _attention_triangle(mode_name: str):
    """(training == prefill, every decode position equal, sequence alone == in the batch)."""
    q, k, v = _qkv(len(LENS), max(LENS), seed=1)
    lens = torch.tensor(LENS, device="cuda", dtype=torch.int32)
    cache_k = torch.full((len(LENS), 1536, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    cache_v = torch.full_like(cache_k, float("nan"))
    cache_k[:, : max(LENS)], cache_v[:, : max(LENS)] = k, v
    zero = torch.zeros(len(LENS), device="cuda", dtype=torch.int32)
    with mode(mode_name):
        train = attention(q, k, v, lens)
        prefill = attention_with_cache(q, cache_k, cache_v, zero, lens)
        pre_ok = all(torch.equal(prefill[b, :n], train[b, :n]) for b, n in enumerate(LENS))
        dec_ok = True
        for b, n in enumerate(LENS):
            for t in _decode_positions(n, seed=b):
                one = attention_with_cache(q[b : b + 1, t : t + 1], cache_k[b : b + 1], cache_v[b : b + 1],
                                           torch.tensor([t], device="cuda"), torch.tensor([t + 1], device="cuda"))
                dec_ok &= torch.equal(one[0, 0], train[b, t])
        n = LENS[1]
        alone = attention(q[1:2, :n], k[1:2, :n], v[1:2, :n])
        alone_ok = torch.equal(alone[0], train[1, :n])
    return pre_ok, dec_ok, alone_ok


def test_gpu_attention_training_prefill_decode_bitwise():
    assert _attention_triangle("invariant") == (True, True, True)


def test_gpu_attention_negative_control_standard_decode_differs():
    _, dec_ok, _ = _attention_triangle("standard")
    assert not dec_ok, "SDPA gave decode == training at every position tried: the control shows nothing"


@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (9, 3, 64), (14, 2, 64)])   # Qwen3-1.7B, SmolLM2, Qwen2-0.5B
def test_gpu_standard_decode_is_flash_attention_over_the_used_keys(hq, hkv, d):
    """A standard decode step reads each sequence's first kv_len cached keys through FlashAttention
    (`seqused_k`, a KV head's query heads as rows of one head): it agrees with the masked SDPA call to bf16
    rounding and never reads the cache past kv_len (NaN there would show)."""
    from workbench.kernels.attention import _flash_decode_ok, _sdpa

    g = torch.Generator(device="cuda").manual_seed(3)
    lens, cap = [1024, 700, 333, 1, 65], 1536
    step = torch.randn(len(lens), 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cache_k = torch.full((len(lens), cap, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    cache_v = torch.full_like(cache_k, float("nan"))
    kv_len = torch.tensor(lens, device="cuda", dtype=torch.int32)
    for b, n in enumerate(lens):
        cache_k[b, :n] = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        cache_v[b, :n] = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    assert _flash_decode_ok(step, cache_k)
    with mode("standard"):
        out = attention_with_cache(step, cache_k, cache_v, kv_len - 1, kv_len)
    ref = _sdpa(step, cache_k.nan_to_num(0.0), cache_v.nan_to_num(0.0), kv_len - 1, kv_len)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, inf where either holds a NaN (Python's max would skip a NaN)."""
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return (a - b).abs().max().item()


def _model_triangle(model, lens, prefill: int, steps: int):
    """Training logits vs prefill + `steps` decode steps through the generator's view (`DecodingModel`, built
    under the caller's modes), per sequence; returns the max |difference| per stage."""
    b, t = len(lens), max(lens)
    decoding = DecodingModel(model)
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (b, t), device="cuda", generator=g)
    seq = torch.tensor(lens, device="cuda", dtype=torch.int32)
    with torch.no_grad():
        train = model(ids, seq_lens=seq).float()
        cache = KVCache.allocate(model.config, b, t + 8, "cuda")
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        first = torch.clamp(seq, max=prefill)
        pre = decoding(ids[:, :prefill], first, cache, torch.zeros_like(seq)).float()
        diffs = [max(_maxdiff(pre[i, : min(n, prefill)], train[i, : min(n, prefill)]) for i, n in enumerate(lens))]
        for s in range(prefill, prefill + steps):
            step = decoding(ids[:, s : s + 1], torch.ones_like(seq), cache, torch.full_like(seq, s)).float()
            live = [i for i, n in enumerate(lens) if s < n]
            diffs.append(max(_maxdiff(step[i, 0], train[i, s]) for i in live))
    return diffs


@pytest.mark.parametrize("shape", ["qwen3-1.7B", "smollm2-135M", "qwen2-0.5B"])
def test_gpu_model_training_equals_prefill_and_decode_bitwise(shape):
    model = build(shape, device="cuda", seed=3)
    diffs = _model_triangle(model, lens=[300, 200, 129], prefill=100, steps=40)
    assert max(diffs) == 0.0, f"max |logit difference| per stage: {diffs}"
    with mode("standard"):
        diffs = _model_triangle(model, lens=[300, 200, 129], prefill=100, steps=40)
    assert max(diffs) > 0.0, "standard mode matched bitwise everywhere: the negative control shows nothing"


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_gpu_model_matches_transformers(family, tmp_path):
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from workbench.models import load_pretrained, save_pretrained

    cfg = dataclasses.replace(config("tiny"), model_type=family, qk_norm=family == "qwen3",
                              attention_bias=family == "qwen2")
    ours = build(cfg, device="cuda", dtype=torch.float32, seed=4)
    save_pretrained(ours, tmp_path / "ckpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").cuda().eval()
    ids = torch.randint(0, 512, (3, 37), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits
        assert rel_err(ours(ids), ref) < 1e-5
        back = load_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16, device="cuda")
        with mode("standard"):
            assert rel_err(back(ids), hf.to(torch.bfloat16)(ids).logits) < 3e-2


@pytest.mark.parametrize("page_size", [16, 64])
def test_gpu_paged_steps_equal_the_training_forward_bitwise(page_size):
    """vLLM's way of running a model (flattened steps mixing prefills, a chunked prefill and decodes over
    shuffled pages) at the 1.7B shape with 4 layers: every token's hidden state is the training forward's,
    and `logprob_rows` of its logits gives the trainer's `token_logprobs` for every vocabulary entry tried."""
    import dataclasses

    from helpers import PagedSim
    from workbench.kernels import linear, logprob_rows, token_logprobs

    cfg = dataclasses.replace(config("qwen3-1.7B"), num_hidden_layers=4)
    model = build(cfg, device="cuda", seed=0)
    g = torch.Generator().manual_seed(1)
    lens = [300, 129, 70, 5]
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lens]
    sim = PagedSim(cfg.num_hidden_layers, 128, page_size, cfg.num_key_value_heads, cfg.head_dim, device="cuda", seed=2)
    schedule = [[(0, (0, 200)), (1, (0, 100))],
                [(0, (200, 290)), (1, (100, 129)), (2, (0, 70)), (3, (0, 3))],
                *[[(0, (290 + i, 291 + i)), (3, (3 + i, 4 + i))] for i in range(2)],
                [(0, (292, 300))]]
    rows = {}
    with mode("invariant"), torch.no_grad():
        decoding = DecodingModel(model)   # vLLM's model runs its paged steps through this view
        for step in schedule:
            ids, pos, cache = sim.step([(s, seqs[s][a:b]) for s, (a, b) in step])
            hidden = decoding.hidden_states_paged(ids, pos, cache)
            for (s, (a, b)), h in zip(step, torch.split(hidden, [b - a for _, (a, b) in step])):
                rows.update({(s, a + i): h[i] for i in range(b - a)})
        ids = torch.zeros((4, max(lens)), dtype=torch.long, device="cuda")
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        train = model.hidden_states(ids, seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"))
        bad = [k for k, h in rows.items() if not torch.equal(h, train[k])]
        assert not bad, f"{len(bad)} of {len(rows)} tokens differ, first {bad[:5]}"
        keys = sorted(rows)[::7]
        lp = logprob_rows(linear(torch.stack([rows[k] for k in keys]), model.lm_head_weight), 0.8)   # [n, V]
        logits = linear(train, model.lm_head_weight)
        for j in torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist():
            want = token_logprobs(logits, torch.full(ids.shape, j, device="cuda"), 0.8)
            assert torch.equal(lp[:, j], torch.stack([want[k] for k in keys])), f"vocabulary entry {j}"


@pytest.mark.parametrize("shape", ["qwen3-1.7B", "smollm2-135M", "qwen2-0.5B"])
def test_gpu_model_backward_at_the_real_shapes(shape):
    """Forward and backward through 4 layers of each shape: gradients the same bits run to run, a
    sequence's log-probs the same alone (in a forward without autograd, the same path) and in the batch,
    gradients close to the standard path's."""
    import dataclasses

    from workbench.kernels import token_logprobs

    cfg = dataclasses.replace(config(shape), num_hidden_layers=4)
    model = build(cfg, device="cuda", seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (6, 256), device="cuda", generator=g)
    lens = torch.tensor([256, 200, 129, 64, 33, 1], device="cuda", dtype=torch.int32)

    def grads(mode_name):
        model.zero_grad(set_to_none=True)
        with mode(mode_name):
            lp = token_logprobs(model(ids, seq_lens=lens), torch.roll(ids, -1, 1))
            mask = torch.arange(256, device="cuda")[None] < lens[:, None] - 1
            (lp * mask).sum().backward()
        return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}

    lp1, g1 = grads("invariant")
    lp2, g2 = grads("invariant")
    assert torch.equal(lp1, lp2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    with torch.no_grad():
        alone = token_logprobs(model(ids[2:3, :129]), torch.roll(ids[2:3, :129], -1, 1))
    assert torch.equal(alone[0, :128], lp1[2, :128])
    _, gs = grads("standard")
    worst = max(rel_err(g1[k], gs[k]) for k in g1)
    assert worst < 5e-2, f"invariant and standard gradients differ by {worst:.3g}"


@pytest.mark.parametrize("shape", ["qwen3-1.7B", "smollm2-135M", "qwen2-0.5B"])
@pytest.mark.parametrize("t", [1, 37], ids=["decode", "prefill"])
def test_gpu_fused_rope_cache_write_is_the_unfused_ops(shape, t):
    """The generation step's norm + RoPE + cache write in one kernel: the bits of rms_norm, apply_rope and the
    scatter, at each family's head shape (the model tests above hold the whole forward to the trainer's)."""
    from test_rope_cache import check_fused_step

    cfg = config(shape)
    check_fused_step("cuda", b=64, t=t, hq=cfg.num_attention_heads, hkv=cfg.num_key_value_heads, d=cfg.head_dim,
                     norm=cfg.qk_norm, cache_len=400, eps=cfg.rms_norm_eps)


@pytest.mark.parametrize("shape", ["qwen3-1.7B", "smollm2-135M"])
@pytest.mark.parametrize("rows", [1, 64, 200, 512])
def test_gpu_swiglu_product_is_the_unfused_ops(shape, rows):
    """The MLP's gate/up products and silu_mul in one kernel: the bits of the packed product then silu_mul in
    each decode bucket's rows (the model tests above hold the whole forward to the trainer's)."""
    from test_swiglu_product import check_swiglu_product

    cfg = config(shape)
    check_swiglu_product("cuda", rows, cfg.hidden_size, cfg.intermediate_size)


@pytest.mark.parametrize("shape", ["qwen3-1.7B", "qwen3-8B"])
def test_gpu_norm_rope_is_the_unfused_ops(shape):
    """The training forward's q/k norm + RoPE in one kernel: the bits of rms_norm then apply_rope at Qwen3's head
    shapes (q and k, contiguous and as packed columns), its gradients close to fp64's, deterministic and per
    sequence."""
    from test_norm_rope import check_backward, check_forward

    cfg = config(shape)
    for heads in (cfg.num_attention_heads, cfg.num_key_value_heads):
        check_forward("cuda", 4, 1024, heads, cfg.head_dim, torch.bfloat16)
        check_forward("cuda", 3, 300, heads, cfg.head_dim, torch.bfloat16, packed=True)
        check_backward("cuda", 4, 1024, heads, cfg.head_dim, torch.bfloat16)

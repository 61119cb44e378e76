"""`rms_norm_qkv_rope_cache`: the norm in the q/k/v product's prologue, q/k's norm, RoPE and the K/V cache write in its
epilogue, one launch; the bits of the decode path it replaces (`rms_norm_linear`, then `rope_cache_write`) and of
the training forward's unfused ops (`rms_norm_add`, `linear`, `rms_norm`, `apply_rope`, the scatter), q, stream and
the whole cache, in the interpreter (fresh random inputs, the seed in the message). The generate test on the tiny
model is tests/test_norm_linear.py's (the decoding view takes this kernel there); the GPU tests are
tests/test_gpu_model.py's and tests/test_gpu_generation.py's."""

import pytest
import torch

from helpers import seed_for
from workbench.kernels import (
    apply_rope, linear, mode, rms_norm, rms_norm_add, rms_norm_linear, rms_norm_qkv_rope_cache, rope_cache_write,
    rope_cos_sin, rope_inv_freq,
)
from workbench.kernels.matmul import matmul
from workbench.kernels.qkv_rope_cache import rms_norm_qkv_rope_cache_reference


def _inputs(seed, b, t, k, hq, hkv, d, qk_norm, cache_len, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    x, res = randn(b, t, k, scale=3.0), randn(b, t, k, scale=3.0)
    norm_w = randn(k, scale=0.2) + 1
    w = randn((hq + 2 * hkv) * d, k, scale=k**-0.5)
    start = torch.randint(0, cache_len - t + 1, (b,), generator=g, dtype=torch.int32).to(device)
    cos, sin = rope_cos_sin(start[:, None] + torch.arange(t, device=device), rope_inv_freq(d, 1e6, device=device))
    qk = (randn(d, scale=0.2) + 1, randn(d, scale=0.2) + 1) if qk_norm else (None, None)
    cache = randn(2, b, cache_len, hkv, d)   # junk everywhere: what is not written must stay
    return x, res, norm_w, w, cos, sin, start, qk, cache


def _decode_path(x, res, norm_w, w, hq, hkv, cos, sin, start, qk, cache, eps, qk_eps):
    """What `DecodingModel` ran before: `rms_norm_linear`, then `rope_cache_write` on its column views."""
    b, t, _ = x.shape
    d = cache.shape[-1]
    y, h = rms_norm_linear(x, res, norm_w, w, eps)
    q, k, v = (u.view(b, t, -1, d) for u in y.split([hq * d, hkv * d, hkv * d], -1))
    return rope_cache_write(q, k, v, cos, sin, cache[0], cache[1], start, *qk, qk_eps), h


def _training_ops(x, res, norm_w, w, hq, hkv, cos, sin, start, qk, cache, eps, qk_eps):
    """The training forward's ops one by one, then the cache scatter."""
    b, t, _ = x.shape
    d = cache.shape[-1]
    y, h = (rms_norm(x, norm_w, eps), x) if res is None else rms_norm_add(x, res, norm_w, eps)
    q, k, v = (u.reshape(b, t, -1, d) for u in linear(y, w).split([hq * d, hkv * d, hkv * d], -1))
    if qk[0] is not None:
        q, k = rms_norm(q.contiguous(), qk[0], qk_eps), rms_norm(k.contiguous(), qk[1], qk_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows = torch.arange(b, device=x.device)[:, None]
    pos = start.long()[:, None] + torch.arange(t, device=x.device)
    cache[0][rows, pos], cache[1][rows, pos] = k, v
    return q, h


def check_fused_qkv(device, b, t, k, hq, hkv, d, qk_norm, residual=True, cache_len=11, eps=1e-5, qk_eps=1e-6):
    """The fused kernel against the decode path it replaces and the training forward's ops: q, the stream and the
    whole cache, bitwise; one sequence alone gets its bits in the batch; close to fp64."""
    seed = seed_for()
    x, res, norm_w, w, cos, sin, start, qk, cache = _inputs(seed, b, t, k, hq, hkv, d, qk_norm, cache_len, device)
    res = res if residual else None
    mine, path, ops = cache.clone(), cache.clone(), cache.clone()
    r = b // 2
    one = cache[:, r : r + 1].clone()
    with mode("invariant"):
        got = rms_norm_qkv_rope_cache(x, res, norm_w, w, hq, hkv, cos, sin, mine[0], mine[1], start, *qk, eps, qk_eps)
        want = _decode_path(x, res, norm_w, w, hq, hkv, cos, sin, start, qk, path, eps, qk_eps)
        unfused = _training_ops(x, res, norm_w, w, hq, hkv, cos, sin, start, qk, ops, eps, qk_eps)
        alone = rms_norm_qkv_rope_cache(x[r : r + 1], None if res is None else res[r : r + 1], norm_w, w, hq, hkv,
                                        cos[r : r + 1], sin[r : r + 1], one[0], one[1], start[r : r + 1], *qk, eps,
                                        qk_eps)
    assert got is not None and got[0].shape == (b, t, hq, d) and got[1].shape == (b, t, k), f"seed {seed}"
    for name, other, cached in (("rms_norm_linear then rope_cache_write", want, path),
                                ("the training forward's ops", unfused, ops)):
        assert torch.equal(got[0], other[0]), f"seed {seed}: q differs from {name}"
        assert torch.equal(got[1], other[1]), f"seed {seed}: the stream differs from {name}"
        assert torch.equal(mine, cached), f"seed {seed}: the cache differs from {name} (new slots or others)"
    assert torch.equal(alone[0], got[0][r : r + 1]) and torch.equal(one, mine[:, r : r + 1]), \
        f"seed {seed}: a sequence alone differs from the same in the batch"
    exact = cache.clone()
    ref = rms_norm_qkv_rope_cache_reference(x, res, norm_w, w, hq, hkv, cos, sin, exact[0], exact[1], start, *qk,
                                            eps, qk_eps)[0]
    torch.testing.assert_close(got[0].double(), ref, atol=0.05, rtol=0.03, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(mine.double(), exact.double(), atol=0.05, rtol=0.03, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("b,t,k,hq,hkv,d,qk_norm,residual", [
    (13, 3, 96, 4, 2, 16, True, True),      # 39 rows: two row tiles (the last ragged), K tail, 3 positions a sequence
    (37, 1, 576, 9, 3, 64, False, True),    # SmolLM2-135M's q/k/v decode step: 15 heads, two row tiles
    (6, 3, 256, 4, 2, 128, True, True),     # Qwen3-like: head dim 128, q/k norm, rows scaled down
    (4, 2, 96, 4, 2, 16, True, False),      # the first layer: no residual, the stream is the embeddings
], ids=["tails-prefill-chunk", "smollm2-decode", "qwen3-like", "no-residual"])
def test_fused_is_the_bits_of_the_product_then_rope_cache_write(b, t, k, hq, hkv, d, qk_norm, residual):
    check_fused_qkv("cpu", b, t, k, hq, hkv, d, qk_norm, residual)


def test_the_comparison_sees_a_rotation_before_the_products_rounding():
    """Negative controls: the same product rotated in fp32 before its one rounding to bf16 (the epilogue working on
    the accumulator), and the standard mode's ops, each differ from the fused kernel somewhere. Bitwise equality
    above is a claim the test can fail."""
    seed = seed_for()
    b, t, k, hq, hkv, d = 8, 1, 96, 4, 2, 16
    x, res, norm_w, w, cos, sin, start, qk, cache = _inputs(seed, b, t, k, hq, hkv, d, False, 9)
    with mode("invariant"):
        q = rms_norm_qkv_rope_cache(x, res, norm_w, w, hq, hkv, cos, sin, cache[0], cache[1], start)[0]
        y, _ = rms_norm_add(x, res, norm_w, 1e-6)
        acc = matmul(y.reshape(-1, k), w.t(), out_dtype=torch.float32)[:, : hq * d].reshape(b, t, hq, d)
        early = apply_rope(acc, cos, sin).bfloat16()
    assert not torch.equal(q, early), f"seed {seed}: rotating the unrounded product gave the same bits"
    with mode("standard"):
        standard = _training_ops(x, res, norm_w, w, hq, hkv, cos, sin, start, qk, cache.clone(), 1e-6, 1e-6)[0]
    assert not torch.equal(q, standard), f"seed {seed}: the standard mode's ops gave the same bits"


def test_where_it_does_not_apply_the_caller_is_told():
    x, res, norm_w, w, cos, sin, start, qk, cache = _inputs(0, 2, 1, 96, 4, 2, 16, True, 5)
    assert rms_norm_qkv_rope_cache(x.float(), res.float(), norm_w.float(), w.float(), 4, 2, cos, sin,
                                   cache[0].float(), cache[1].float(), start, *qk) is None, "fp32: the unfused ops"
    assert rms_norm_qkv_rope_cache(x, res, norm_w, w, 5, 1, cos, sin, cache[0], cache[1], start, *qk) is None, \
        "the heads do not match the cache's"
    x, res, norm_w, w, cos, sin, start, qk, cache = _inputs(0, 2, 1, 96, 2, 1, 24, True, 5)
    assert rms_norm_qkv_rope_cache(x, res, norm_w, w, 2, 1, cos, sin, cache[0], cache[1], start, *qk) is None, \
        "a head dim not a power of 2: no tile of whole heads"

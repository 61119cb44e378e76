"""`rope_cache_write`: the norm, rotation and cache write of a generation step in one kernel, the bits of the
unfused ops (rms_norm, apply_rope, the cache scatter) in the interpreter; the GPU test holds it on the device."""

import pytest
import torch

from helpers import seed_for
from workbench.kernels import apply_rope, mode, rms_norm, rope_cache_write, rope_cos_sin, rope_inv_freq
from workbench.kernels.rope_cache import rope_cache_write_reference


def _inputs(seed, b, t, hq, hkv, d, cache_len, norm, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    # q, k, v as the column slices of one packed product, as the model hands them over.
    qkv = randn(b, t, (hq + 2 * hkv) * d, scale=3.0)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
    start = torch.randint(0, cache_len - t + 1, (b,), generator=g, dtype=torch.int32).to(device)
    positions = start[:, None] + torch.arange(t, device=device)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(d, 1_000_000.0, device=device))
    weights = (randn(d, scale=0.2) + 1, randn(d, scale=0.2) + 1) if norm else (None, None)
    cache = randn(2, b, cache_len, hkv, d)          # junk everywhere: what is not written must stay
    return q, k, v, cos, sin, cache, start, weights


def _unfused(q, k, v, cos, sin, cache, start, weights, eps):
    if weights[0] is not None:
        q, k = rms_norm(q.contiguous(), weights[0], eps), rms_norm(k.contiguous(), weights[1], eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows = torch.arange(q.shape[0], device=q.device)[:, None]
    pos = start.long()[:, None] + torch.arange(q.shape[1], device=q.device)
    cache[0][rows, pos] = k
    cache[1][rows, pos] = v
    return q


def check_fused_step(device, b, t, hq, hkv, d, norm, cache_len, eps=1e-6):
    """The fused kernel against the unfused ops on fresh random inputs: q and the whole cache, bitwise; and
    against the fp64 reference within bf16's tolerance."""
    seed = seed_for()
    q, k, v, cos, sin, cache, start, weights = _inputs(seed, b, t, hq, hkv, d, cache_len, norm, device)
    mine = cache.clone()
    theirs = cache.clone()
    with mode("invariant"):
        out = rope_cache_write(q, k, v, cos, sin, mine[0], mine[1], start, *weights, eps)
        ref = _unfused(q, k, v, cos, sin, theirs, start, weights, eps)
    assert out.is_contiguous() and out.shape == (b, t, hq, d)
    assert torch.equal(out, ref), f"seed {seed}: q differs from the unfused ops"
    assert torch.equal(mine, theirs), f"seed {seed}: the cache differs (new slots, or ones it should not touch)"
    exact = cache.clone()
    ref64 = rope_cache_write_reference(q, k, v, cos, sin, exact[0], exact[1], start, *weights, eps)
    torch.testing.assert_close(out.double(), ref64, atol=0.05, rtol=0.02)
    torch.testing.assert_close(mine.double(), exact.double(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill"])
def test_fused_step_is_the_bits_of_the_unfused_ops(norm, t):
    check_fused_step("cpu", b=3, t=t, hq=4, hkv=2, d=16, norm=norm, cache_len=9)


def test_each_token_and_head_is_its_own_row():
    """A token's outputs do not depend on the other rows of the batch: one request alone gets the same bits."""
    q, k, v, cos, sin, cache, start, weights = _inputs(5, 4, 1, 4, 2, 16, 7, True)
    full = cache.clone()
    out = rope_cache_write(q, k, v, cos, sin, full[0], full[1], start, *weights)
    one = cache[:, 2:3].clone()
    alone = rope_cache_write(q[2:3], k[2:3], v[2:3], cos[2:3], sin[2:3], one[0], one[1], start[2:3], *weights)
    assert torch.equal(alone, out[2:3])
    assert torch.equal(one, full[:, 2:3])


def test_bad_inputs_are_named():
    q, k, v, cos, sin, cache, start, weights = _inputs(6, 2, 1, 4, 2, 16, 5, True)
    with pytest.raises(ValueError, match="cos and sin must be fp32"):
        rope_cache_write(q, k, v, cos.double(), sin, cache[0], cache[1], start, *weights)
    with pytest.raises(ValueError, match="both q and k norm weights"):
        rope_cache_write(q, k, v, cos, sin, cache[0], cache[1], start, weights[0], None)
    with pytest.raises(ValueError, match="the cache must be"):
        rope_cache_write(q, k, v, cos, sin, cache[0][:, :, :1], cache[1][:, :, :1], start, *weights)
    with pytest.raises(ValueError, match="start must be integer"):
        rope_cache_write(q, k, v, cos, sin, cache[0], cache[1], start.float(), *weights)

"""`norm_rope`: a training forward's q/k RMSNorm and RoPE in one kernel, forward and backward, in the interpreter: the
unfused invariant ops' bits forward, each token's rows independent of the batch, gradients against fp64; the GPU
test (`tests/test_gpu_model.py`) holds the same checks on the device."""

import pytest
import torch

from helpers import rel_err, seed_for
from workbench.kernels import apply_rope, mode, rms_norm, rope_cos_sin, rope_inv_freq
from workbench.kernels.norm_rope import norm_rope, norm_rope_reference


def _inputs(seed, b, t, h, d, dtype, device="cpu", packed=False):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)

    if packed:  # the q columns of one packed q/k/v product: token stride wider than the heads
        x = randn(b, t, 2 * h * d, scale=3.0)[..., : h * d].view(b, t, h, d)
    else:
        x = randn(b, t, h, d, scale=3.0)
    positions = torch.randint(0, 4096, (b, t), generator=g).to(device)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(d, 1_000_000.0, device=device))
    return x, randn(d, scale=0.2) + 1, cos, sin


def check_forward(device, b, t, h, d, dtype, packed=False):
    """Bitwise the unfused invariant ops on fresh random inputs, and within tolerance of fp64."""
    seed = seed_for()
    x, w, cos, sin = _inputs(seed, b, t, h, d, dtype, device, packed)
    with mode("invariant"):
        out = norm_rope(x, w, cos, sin)
        ref = apply_rope(rms_norm(x.contiguous(), w), cos, sin)
    assert out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, ref), f"seed {seed}: differs from rms_norm then apply_rope"
    tol = 1e-5 if dtype == torch.float32 else 0.03
    torch.testing.assert_close(out.double(), norm_rope_reference(x, w, cos, sin), atol=tol, rtol=tol)


def check_backward(device, b, t, h, d, dtype):
    """d(x), d(weight) against the fp64 reference's; run twice, the same bits; each token's d(x) that of the
    call on its sequence alone."""
    seed = seed_for()
    x, w, cos, sin = _inputs(seed, b, t, h, d, dtype, device)
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)

    def grads(x, w, cos, sin, dout):
        x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
        with mode("invariant"):
            norm_rope(x, w, cos, sin).backward(dout)
        return x.grad, w.grad

    dx, dw = grads(x, w, cos, sin, dout)
    dx2, dw2 = grads(x, w, cos, sin, dout)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2), f"seed {seed}: not deterministic"
    alone, _ = grads(x[1:2], w, cos[1:2], sin[1:2], dout[1:2])
    assert torch.equal(alone, dx[1:2]), f"seed {seed}: a sequence's d(x) depends on the batch"
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    norm_rope_reference(x64, w64, cos, sin).backward(dout.double())
    tol = 1e-5 if dtype == torch.float32 else 0.03
    torch.testing.assert_close(dx.double(), x64.grad, atol=tol, rtol=tol)
    # d(weight) sums dy * round(n) over every token and head (the bf16 rounding of n is the forward's): judged as a
    # whole, its error a random walk of those roundings.
    assert rel_err(dw, w64.grad) < (1e-6 if dtype == torch.float32 else 1e-2), f"seed {seed}: d(weight)"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("h,d", [(4, 16), (3, 12)], ids=["pow2", "odd-sizes"])
def test_forward_is_the_unfused_ops_bits(h, d, dtype):
    check_forward("cpu", 2, 37, h, d, dtype)
    check_forward("cpu", 1, 3, h, d, dtype, packed=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_backward_against_fp64_deterministic_and_per_sequence(dtype):
    check_backward("cpu", 3, 41, 4, 16, dtype)
    check_backward("cpu", 2, 5, 3, 12, dtype)


def test_rows_do_not_depend_on_the_batch():
    """A token's output from a batch of 70 tokens (three programs in the interpreter) equals its own call's."""
    x, w, cos, sin = _inputs(7, 1, 70, 4, 16, torch.bfloat16)
    with mode("invariant"):
        out = norm_rope(x, w, cos, sin)
        for r in (0, 33, 69):
            assert torch.equal(norm_rope(x[:, r : r + 1], w, cos[:, r : r + 1], sin[:, r : r + 1]), out[:, r : r + 1])


def test_bad_inputs_are_named():
    x, w, cos, sin = _inputs(0, 1, 4, 2, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="weight"):
        norm_rope(x, w[:4], cos, sin)
    with pytest.raises(ValueError, match="cos must be fp32"):
        norm_rope(x, w, cos.double(), sin)
    with pytest.raises(ValueError, match="sin must be fp32"):
        norm_rope(x, w, cos, sin[:, :2])
    with pytest.raises(TypeError, match="share x's dtype"):
        norm_rope(x, w.float(), cos, sin)
    with pytest.raises(ValueError, match="eps must be a positive number"):
        norm_rope(x, w, cos, sin, eps=0.0)
    with pytest.raises(TypeError, match="bfloat16 and"):
        norm_rope(x.half(), w.half(), cos, sin)

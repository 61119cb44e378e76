"""rms_norm_add, (RMSNorm(x + residual), x + residual) in one pass: the unfused add and norm, on CPU (the
interpreter) and on a GPU; its contract "row-invariant" and its accuracy also hold through the registry's generic
tests (tests/test_kernels.py, tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err, seed_for

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _rms_add_case(device, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(37, 96, generator=g).bfloat16().to(device) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).bfloat16().to(device)
    dy, dh = (torch.randn(37, 96, generator=g).bfloat16().to(device) for _ in range(2))
    return x, r, w, dy, dh


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_add_is_the_unfused_add_and_norm(device):
    """rms_norm_add(x, r) is (rms_norm(h), h) with h = x + r, forward: bit for bit on a GPU; in the interpreter
    (whose fp32 -> bf16 cast truncates) h is within an ulp of torch's rounded add and y is the norm of that
    h, bitwise. Its gradients are the unfused chain's (dx + dh rounded once instead of twice: close), and x
    and r get the same one."""
    from workbench.kernels import mode, rms_norm, rms_norm_add

    seed = seed_for()
    x, r, w, dy, dh = _rms_add_case(device, seed)
    with mode("invariant"):
        xs, rs, ws = (t.clone().requires_grad_(True) for t in (x, r, w))
        y, h = rms_norm_add(xs, rs, ws)
        if device == "cpu":
            assert rel_err(h, (x + r).double()) < 1e-2 and torch.equal(y, rms_norm(h.detach(), w)), f"seed {seed}"
        else:
            assert torch.equal(h, x + r) and torch.equal(y, rms_norm(x + r, w)), f"seed {seed}"
        torch.autograd.backward((y, h), (dy, dh))
        xu, ru, wu = (t.clone().requires_grad_(True) for t in (x, r, w))
        hu = xu + ru
        torch.autograd.backward((rms_norm(hu, wu), hu), (dy, dh))
    assert torch.equal(xs.grad, rs.grad), f"seed {seed}"
    assert rel_err(xs.grad, xu.grad.double()) < 2e-2, f"seed {seed}"
    assert (rel_err(ws.grad, wu.grad.double()) < 2e-2 if device == "cpu" else torch.equal(ws.grad, wu.grad)), \
        f"seed {seed}"
    with mode("standard"):
        y_std, h_std = rms_norm_add(x, r, w)
    assert torch.equal(h_std, x + r) and rel_err(y_std, y.double()) < 2e-2, f"seed {seed}"

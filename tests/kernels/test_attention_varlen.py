"""attention_varlen (sequences packed without padding): in `invariant` mode its output and its dQ, dK, dV are the
padded kernel's (`attention`) bits for each sequence, whatever the packing; `standard` mode is close to fp64 and not
those bits (the negative control); bad metadata is named. CPU (interpreter) at small widths, and on a GPU at
SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, lengths up to 1,100)."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import rel_err, seed_for, tolerance
from workbench.kernels import attention, attention_varlen, mode
from workbench.kernels.attention_varlen import attention_varlen_reference


def _draw(seed: int, n_seq: int, longest: int, hq: int, hkv: int, d: int, device: str):
    """Random lengths (one of 1, one of `longest`, crossing several KV tiles, the rest uniform) in random order;
    q, k, v packed; an upstream gradient."""
    rng = random.Random(seed)
    lens = [1, longest] + [rng.randint(1, longest) for _ in range(n_seq - 2)]
    rng.shuffle(lens)
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v, do = (torch.randn(n, h, d, generator=g).bfloat16().to(device) for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return lens, cu, q, k, v, do


def _pad(x, lens, cu):
    out = x.new_zeros(len(lens), max(lens), *x.shape[1:])
    for b, (lo, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        out[b, :n] = x[lo:lo + n]
    return out


def _unpad(x, lens):
    return torch.cat([x[b, :n] for b, n in enumerate(lens)])


def _forward_backward(fn, do, *args):
    leaves = [a.detach().requires_grad_() for a in args[:3]]
    out = fn(*leaves, *args[3:])
    out.backward(do)
    return out.detach(), [x.grad for x in leaves]


def _check_padded_bits(lens, cu, q, k, v, do, seed):
    out, (dq, dk, dv) = _forward_backward(attention_varlen, do, q, k, v, cu, max(lens))
    p_out, p_grads = _forward_backward(attention, _pad(do, lens, cu), *(_pad(x, lens, cu) for x in (q, k, v)),
                                       torch.tensor(lens, dtype=torch.int32, device=q.device))
    assert torch.equal(out, _unpad(p_out, lens)), f"seed {seed}: forward, lengths {lens}"
    for name, mine, theirs in zip("qkv", (dq, dk, dv), p_grads):
        assert torch.equal(mine, _unpad(theirs, lens)), f"seed {seed}: d{name}, lengths {lens}"
    return out


@pytest.mark.parametrize("hq, hkv", [(6, 2), (2, 2)])   # GQA 3:1 as SmolLM2's 9:3, and plain heads
def test_forward_and_gradients_are_the_padded_kernels_bits(hq, hkv):
    """Length 1, a length over three KV tiles (the CPU's BLOCK_N is 16) and random ones, in random order: every real
    row's output and dQ/dK/dV equal the padded batch's bitwise (the same tiles, sums and order by construction)."""
    seed = seed_for(hq)
    lens, cu, q, k, v, do = _draw(seed, 4, 53, hq, hkv, 16, "cpu")
    out = _check_padded_bits(lens, cu, q, k, v, do, seed)
    ref = attention_varlen_reference(q, k, v, cu, max(lens))
    assert rel_err(out, ref) < tolerance(torch.bfloat16, False), f"seed {seed}"


def test_a_sequences_bits_do_not_follow_the_packing_and_standard_mode_is_the_control():
    """Invariant: a sequence's rows are the same bits alone and packed after others. Standard (SDPA over the padded
    sequences on the CPU): close to fp64, and not the invariant kernel's bits."""
    seed = seed_for()
    lens, cu, q, k, v, _ = _draw(seed, 3, 40, 4, 2, 16, "cpu")
    out = attention_varlen(q, k, v, cu, max(lens))
    lo, hi = int(cu[-2]), int(cu[-1])
    alone = attention_varlen(q[lo:hi], k[lo:hi], v[lo:hi], torch.tensor([0, hi - lo], dtype=torch.int32), hi - lo)
    assert torch.equal(out[lo:hi], alone), f"seed {seed}: the last sequence alone"
    with mode("standard"):
        std = attention_varlen(q, k, v, cu, max(lens))
    ref = attention_varlen_reference(q, k, v, cu, max(lens))
    assert rel_err(std, ref) < tolerance(torch.bfloat16, False), f"seed {seed}"
    assert not torch.equal(std, out), f"seed {seed}: standard mode gave the invariant kernel's bits"


@pytest.mark.parametrize("cu, max_len", [([0, 6, 3, 10], 7), ([1, 10], 9), ([0, 4, 10], 4), ([0, 4, 12], 8),
                                          ([0, 4, 8], 8)])
def test_bad_metadata_is_named(cu, max_len):
    """Falling, not from 0, a step over max_len, past the rows, short of them: one ValueError naming cu_seqlens."""
    q, k, v = torch.zeros(10, 2, 16).bfloat16(), torch.zeros(10, 1, 16).bfloat16(), torch.zeros(10, 1, 16).bfloat16()
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0"):
        attention_varlen(q, k, v, torch.tensor(cu, dtype=torch.int32), max_len)
    with pytest.raises(ValueError, match="int32"):
        attention_varlen(q, k, v, torch.tensor([0, 10]), 10)


@pytest.mark.gpu
@pytest.mark.parametrize("n_seq", [8, 33])
def test_gpu_real_widths_are_the_padded_kernels_bits_and_flash_is_close(n_seq):
    """SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64), lengths up to 1,100: forward and
    gradients bitwise the padded kernel's; standard mode (FlashAttention-2 varlen) close to fp64 and its gradients
    close to the invariant kernel's."""
    seed = seed_for(n_seq)
    lens, cu, q, k, v, do = _draw(seed, n_seq, 1100, 9, 3, 64, "cuda")
    out = _check_padded_bits(lens, cu, q, k, v, do, seed)
    ref = attention_varlen_reference(q, k, v, cu, max(lens))
    assert rel_err(out, ref) < tolerance(torch.bfloat16, True), f"seed {seed}"
    with mode("standard"):
        std, std_grads = _forward_backward(attention_varlen, do, q, k, v, cu, max(lens))
    _, grads = _forward_backward(attention_varlen, do, q, k, v, cu, max(lens))
    assert rel_err(std, ref) < tolerance(torch.bfloat16, True), f"seed {seed}"
    assert not torch.equal(std, out), f"seed {seed}: standard mode gave the invariant kernel's bits"
    for name, mine, theirs in zip("qkv", grads, std_grads):
        assert rel_err(theirs, mine) < 2e-2, f"seed {seed}: standard d{name}"

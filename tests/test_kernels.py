"""Every op of the registry, on CPU through the Triton interpreter: accuracy vs
fp64, bitwise batch invariance, bitwise run-to-run determinism."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from helpers import check_against_fp64, forward_backward, pad_rows, rel_err, take_rows, tolerance
from workbench.kernels import REGISTRY

OPS = sorted(REGISTRY)
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(op, rows, dtype, seed):
    return op.make_inputs(rows, "small", torch.Generator().manual_seed(seed), "cpu", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_forward_and_gradients_match_fp64(name, dtype):
    op = REGISTRY[name]
    check_against_fp64(op, _inputs(op, 11, dtype, seed=1), on_gpu=False)


def invariance_violations(fn, args, row_args, r: int, others, pad_after: int) -> list[str]:
    """Where fn's row r differs from the same row computed alone: in the batch, with the other rows
    replaced by `others`, and alone between zero padding rows."""
    one = take_rows(args, row_args, slice(r, r + 1))
    alone = fn(*one)
    bad = []
    if not torch.equal(fn(*args)[r : r + 1], alone):
        bad.append("in the batch")
    mixed = tuple(
        torch.cat([o[:r], a[r : r + 1], o[r + 1 :]]) if i in row_args else a
        for i, (a, o) in enumerate(zip(args, others))
    )
    if not torch.equal(fn(*mixed)[r : r + 1], alone):
        bad.append("other rows changed")
    if not torch.equal(fn(*pad_rows(one, row_args, before=3, after=pad_after))[3:4], alone):
        bad.append("zero padding")
    return bad


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_row_is_batch_invariant(name, dtype):
    """op(x[r:r+1]) == op(x)[r:r+1] bitwise, with other rows random, changed, or zero padding."""
    op = REGISTRY[name]
    rng = random.Random(zlib.crc32(f"{name}-{dtype}".encode()))
    for trial in range(2):
        m = rng.randint(1, op.max_rows)
        r = rng.randrange(m)
        args = _inputs(op, m, dtype, seed=100 + trial)
        others = _inputs(op, m, dtype, seed=200 + trial)
        bad = invariance_violations(op.invariant, args, op.row_args, r, others, rng.randint(1, 20))
        assert not bad, f"{name}: row {r} of M={m} differs {bad}"


@pytest.mark.parametrize("name", OPS)
def test_row_gradient_is_batch_invariant(name):
    """The gradient reaching a row's inputs does not depend on the other rows either."""
    op = REGISTRY[name]
    m, r = 13, 5
    args = _inputs(op, m, torch.bfloat16, seed=3)
    one = take_rows(args, op.row_args, slice(r, r + 1))
    out_one, grads_one = forward_backward(op.invariant, one, op.grad_args)
    g_row = torch.randn(out_one.shape, generator=torch.Generator().manual_seed(7))
    g = torch.zeros((m, *out_one.shape[1:]))
    g[r : r + 1] = g_row
    _, grads = forward_backward(op.invariant, args, op.grad_args, upstream=g)
    for k, i in enumerate(op.grad_args):
        if i in op.row_args:
            assert torch.equal(grads[k][r : r + 1], grads_one[k]), f"{name}: grad of arg {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_forward_and_backward_are_deterministic(name, dtype):
    op = REGISTRY[name]
    args = _inputs(op, min(17, op.max_rows // 2), dtype, seed=5)
    out1, grads1 = forward_backward(op.invariant, args, op.grad_args)
    out2, grads2 = forward_backward(op.invariant, args, op.grad_args)
    assert torch.equal(out1, out2)
    for a, b in zip(grads1, grads2):
        assert torch.equal(a, b)


def test_the_invariance_check_catches_a_batch_dependent_split_k():
    """Negative control on the CPU: a linear whose split-K count follows M (as a BLAS may choose)
    fails the very check the kernels pass."""

    def split_k_linear(x, w):
        splits = 1 if x.shape[0] < 8 else 4
        parts = [xc @ wc.t() for xc, wc in zip(x.chunk(splits, -1), w.chunk(splits, -1))]
        out = parts[0].to(torch.bfloat16)
        for p in parts[1:]:
            out = (out.float() + p).to(torch.bfloat16)
        return out

    g = torch.Generator().manual_seed(9)
    x, others, w = (torch.randn(n, 256, generator=g) for n in (16, 16, 64))
    bad = invariance_violations(split_k_linear, (x, w), (0,), 5, (others, w), 10)
    assert "in the batch" in bad and "other rows changed" in bad
    inv = REGISTRY["linear"].invariant
    xb, ob, wb = x.bfloat16(), others.bfloat16(), w.bfloat16()
    assert invariance_violations(inv, (xb, wb), (0,), 5, (ob, wb), 10) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tma_matmul_kernel_is_accurate_in_every_layout(dtype):
    """The TMA kernel (a GPU's default for aligned operands) in the three layouts of forward and backward.

    Its bits are checked against the pointer kernel on the GPU (tests/test_gpu.py); the
    interpreter's dots round differently per memory layout, so here it is checked for accuracy.
    """
    from workbench.kernels.matmul import matmul

    g = torch.Generator().manual_seed(11)
    x = torch.randn(21, 64, generator=g).to(dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    dy = torch.randn(21, 48, generator=g).to(dtype)
    tol = tolerance(dtype, on_gpu=False)
    for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):
        out = matmul(a, b, tma=True)
        assert rel_err(out, a.double() @ b.double()) < tol
        assert torch.equal(out, matmul(a, b, tma=True))
    with pytest.raises(ValueError, match="tma=True needs"):
        matmul(torch.empty(21, 65, dtype=dtype)[:, :64], w.t(), tma=True)


def test_logprobs_are_the_same_bits_with_or_without_the_entropy_sums():
    from workbench.kernels.logprobs import logprobs_and_entropy_invariant

    logits, tokens = _inputs(REGISTRY["token_logprobs"], 9, torch.bfloat16, seed=12)
    both = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=True)
    alone = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=False)
    assert torch.equal(both[0], alone[0]) and torch.isnan(alone[1]).all()


def _bias_linear_op():
    """`linear` with a bias (Qwen2's q/k/v projections) as an Op the generic checks take."""
    from workbench.kernels import matmul
    from workbench.kernels.registry import Op

    def make(rows, size, g, device, dtype):
        x, w = REGISTRY["linear"].make_inputs(rows, size, g, device, dtype)
        return x, w, (torch.randn(w.shape[0], generator=g) * 0.5).to(device=device, dtype=dtype)

    return Op("linear", matmul.linear_invariant, matmul.linear_standard, matmul.linear_reference, make,
              row_args=(0,), grad_args=(0, 1, 2), tile_config=matmul.tile_config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_with_bias_is_accurate_and_batch_invariant(dtype):
    op = _bias_linear_op()
    check_against_fp64(op, _inputs(op, 11, dtype, seed=13), on_gpu=False)
    args, others = _inputs(op, 23, dtype, seed=14), _inputs(op, 23, dtype, seed=15)
    others = (others[0], *args[1:])
    assert invariance_violations(op.invariant, args, op.row_args, 6, others, 9) == []
    # One rounding: the fp32 product plus the bias, cast once.
    x, w, b = args
    from workbench.kernels.matmul import matmul

    want = (matmul(x, w.t(), out_dtype=torch.float32, tma=False) + b.float()).to(dtype)
    assert torch.equal(op.invariant(x, w, b), want)

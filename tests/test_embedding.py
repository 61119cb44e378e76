"""`embedding` (the token embedding: a gather forward, a sorted, deterministic backward), on CPU through the
Triton interpreter: the forward's bits, the backward's bits (each id's rows summed in token order in fp32, then
one add into the target), fp64 accuracy, the fp32 `main_grad` target, long runs of one id, determinism, and the
input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err, tolerance

from workbench.kernels import embedding, mode
from workbench.kernels.embedding import embedding_grad_reference, embedding_reference

DTYPES = [torch.float32, torch.bfloat16]
V, H = 97, 80  # H: not a power of 2, so the interpreter's 128-column block is partly masked


def _inputs(shape, dtype, seed, v=V, h=H, ids_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=g).to(dtype)
    ids = torch.randint(0, v, shape, generator=g).to(ids_dtype)
    dy = torch.randn(*shape, h, generator=g).to(dtype)
    return ids, weight, dy


def _padded_ids(seed, n=420, pad=3, run=300):
    """[n] ids: `run` copies of `pad` (a padding id) at the end, random ids (repeats among them) before."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n,), generator=g)
    ids[n - run:] = pad
    return ids


def _token_order_sums(ids, dy, start):
    """The contract, spelled out: per id, -0.0 + its rows of dy in token order in fp32, then start[v] + sum."""
    out = start.clone()
    flat, rows = ids.reshape(-1), dy.reshape(-1, dy.shape[-1]).float()
    for v in flat.unique().tolist():
        s = torch.full((dy.shape[-1],), -0.0)
        for t in (flat == v).nonzero()[:, 0].tolist():
            s = s + rows[t]
        out[v] = out[v] + s
    return out


def _backward(ids, weight, dy, main_grad=None):
    """(weight.grad, weight.main_grad) after backpropagating dy through embedding(ids, weight)."""
    w = torch.nn.Parameter(weight.clone())
    if main_grad is not None:
        w.main_grad = main_grad.clone()
    embedding(ids, w).backward(dy)
    return w.grad, getattr(w, "main_grad", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_is_the_gather(dtype):
    for shape, ids_dtype in (((4, 13), torch.int64), ((29,), torch.int32)):
        ids, weight, _ = _inputs(shape, dtype, seed=1, ids_dtype=ids_dtype)
        for name in ("invariant", "standard"):
            with mode(name):
                out = embedding(ids, weight)
            assert out.shape == (*shape, H) and out.dtype == dtype
            assert torch.equal(out, weight[ids.long()]), (shape, name)
        assert torch.equal(embedding_reference(ids.long(), weight), weight.double()[ids.long()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_matches_fp64_and_torch(dtype):
    """Without main_grad: the gradient comes back in the weight's dtype, close to fp64's, and (fp32) to torch's."""
    ids, weight, dy = _inputs((6, 40), dtype, seed=2)  # 240 ids over 97 rows: many repeats
    grad, main_grad = _backward(ids, weight, dy)
    assert main_grad is None and grad.dtype == dtype
    ref = embedding_grad_reference(ids, dy, V)
    assert rel_err(grad, ref) < tolerance(dtype, on_gpu=False), rel_err(grad, ref)
    if dtype == torch.float32:
        w = weight.clone().requires_grad_(True)
        (torch_grad,) = torch.autograd.grad(F.embedding(ids, w), w, dy)
        assert rel_err(grad, torch_grad) < 1e-6, rel_err(grad, torch_grad)
    # Rows no id points at get exact zeros.
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[ids.reshape(-1)] = False
    assert untouched.any() and not grad[untouched].any()


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_bits_are_the_token_order_sums(dtype, ids_dtype):
    """Each id's rows summed in token order in fp32 (a 300-long run of a padding id among them), added into
    main_grad with one fp32 add (its nonzero start kept), or onto zeros and cast once; twice the same bits."""
    ids = _padded_ids(seed=3).to(ids_dtype).view(12, 35)
    _, weight, dy = _inputs((12, 35), dtype, seed=4)
    start = torch.randn(V, H, generator=torch.Generator().manual_seed(5))
    expected = _token_order_sums(ids.long(), dy, start)

    grad, main_grad = _backward(ids, weight, dy, main_grad=start)
    assert grad is None and main_grad.dtype == torch.float32
    assert torch.equal(main_grad, expected)
    ref = start.double() + embedding_grad_reference(ids.long(), dy, V)
    assert rel_err(main_grad, ref) < tolerance(torch.float32, on_gpu=False)
    assert torch.equal(_backward(ids, weight, dy, main_grad=start)[1], main_grad)  # run to run

    grad, _ = _backward(ids, weight, dy)
    assert torch.equal(grad, _token_order_sums(ids.long(), dy, torch.zeros(V, H)).to(dtype))
    assert torch.equal(_backward(ids, weight, dy)[0], grad)


def test_main_grad_of_the_wrong_kind_raises():
    ids, weight, dy = _inputs((7,), torch.bfloat16, seed=6)
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.zeros(V, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"`main_grad` must be an fp32 \(97, 80\) tensor"):
        embedding(ids, w).backward(dy)


def test_no_ids_and_frozen_weight():
    _, weight, _ = _inputs((1,), torch.bfloat16, seed=7)
    w = weight.clone().requires_grad_(True)
    out = embedding(torch.zeros(0, 5, dtype=torch.int64), w)
    assert out.shape == (0, 5, H)
    (grad,) = torch.autograd.grad(out.sum(), w)
    assert torch.equal(grad, torch.zeros_like(w))
    ids = torch.tensor([3, 1, 3])
    assert not embedding(ids, weight).requires_grad  # a frozen (LoRA base) weight: no backward at all


def test_bad_inputs_raise_clear_errors():
    ids, weight, _ = _inputs((5,), torch.bfloat16, seed=8)
    cases = [
        ((ids.float(), weight), TypeError, "`ids` must be an int64 or int32 tensor"),
        ((ids.tolist(), weight), TypeError, "`ids` must be an int64 or int32 tensor"),
        ((ids.to(torch.int16), weight), TypeError, "`ids` must be an int64 or int32 tensor"),
        ((ids, weight.half()), TypeError, "bfloat16 and torch.float32"),
        ((ids, weight.tolist()), TypeError, "`weight` must be a torch.Tensor"),
        ((ids, weight[0]), ValueError, r"`weight` must be 2-D \[V, H\]"),
        ((ids.to("meta"), weight), ValueError, "move them to one device"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            embedding(*args)

"""`linear_logprobs` (LM head fused with log-probs / entropy, in row chunks), on CPU through the Triton interpreter:
the unfused invariant path's bits, independence of the chunking and of the batch, fp64 accuracy of the forward
and the gradients in both modes and mixed overrides, d(weight) into an fp32 `main_grad`, the last chunk's logits
kept from the forward (and only when a gradient will be needed), the mode captured at forward time, and the input
checks."""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch
from helpers import rel_err, tolerance

from workbench.kernels import linear, linear_logprobs, mode, token_logprobs, token_logprobs_and_entropy
from workbench.kernels.linear_logprobs import linear_logprobs_reference

# The module itself (the package's `linear_logprobs` is the function).
fused_module = importlib.import_module("workbench.kernels.linear_logprobs")

DTYPES = [torch.float32, torch.bfloat16]
V = 600  # more than one of the interpreter's 256-column matmul tiles and of the row kernels' vocabulary chunks


def _inputs(n, h, dtype, seed, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(dtype)  # logits of order 1, peaked rows here and there
    tokens = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, tokens


def _upstream(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


def _grads(fn, hidden, weight, g_lp, g_ent=None):
    """(logp, entropy, d hidden, d weight) of sum(logp * g_lp) + sum(entropy * g_ent) (a None g: no such term)."""
    hidden, weight = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    lp, ent = fn(hidden, weight)
    loss = 0.0
    if g_lp is not None:
        loss = loss + (lp.double() * g_lp.double()).sum()
    if g_ent is not None:
        loss = loss + (ent.double() * g_ent.double()).sum()
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    return lp.detach(), None if ent is None else ent.detach(), dh, dw


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_forward_is_the_unfused_bits_for_any_chunking(dtype, temperature):
    n = 29
    hidden, weight, tokens = _inputs(n, 64, dtype, seed=1)
    with mode("invariant"):
        logits = linear(hidden, weight)
        ref_lp, ref_ent = token_logprobs_and_entropy(logits, tokens, temperature)
        ref_lp_only = token_logprobs(logits, tokens, temperature)
        assert torch.equal(ref_lp, ref_lp_only)
        for chunk in (1, 7, n, n + 5, None):
            lp, ent = linear_logprobs(hidden, weight, tokens, temperature, with_entropy=True, chunk_rows=chunk)
            assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent), chunk
        lp, ent = linear_logprobs(hidden, weight, tokens, temperature, chunk_rows=5)
        assert ent is None and torch.equal(lp, ref_lp)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_rows_do_not_depend_on_the_batch(dtype):
    """Rows of a bigger call (different chunk boundaries, other rows) equal the call on those rows alone; a
    strided hidden gives the same bits as a contiguous one."""
    hidden, weight, tokens = _inputs(70, 96, dtype, seed=2)
    with mode("invariant"):
        big_lp, big_ent = linear_logprobs(hidden, weight, tokens, 0.7, with_entropy=True)
        for rows in (slice(0, 23), slice(17, 40)):
            lp, ent = linear_logprobs(hidden[rows], weight, tokens[rows], 0.7, with_entropy=True, chunk_rows=6)
            assert torch.equal(lp, big_lp[rows]) and torch.equal(ent, big_ent[rows]), rows
        wide = torch.cat([hidden, torch.ones_like(hidden)], dim=1)[:, :96]  # row stride 192
        lp, ent = linear_logprobs(wide, weight, tokens, 0.7, with_entropy=True, chunk_rows=32)
        assert torch.equal(lp, big_lp) and torch.equal(ent, big_ent)


@pytest.mark.parametrize("terms", ["logp", "logp+entropy", "entropy"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["invariant", "standard"])
def test_forward_and_gradients_match_fp64(name, dtype, terms):
    n, temperature = 37, 0.7
    hidden, weight, tokens = _inputs(n, 96, dtype, seed=3)
    g_lp, g_ent = _upstream(n, seed=4)
    g_lp = g_lp if "logp" in terms else None
    g_ent = g_ent if "entropy" in terms else None
    ref = _grads(lambda h, w: linear_logprobs_reference(h, w, tokens, temperature),
                 hidden.double(), weight.double(), g_lp, g_ent)
    with mode(name):
        out = _grads(lambda h, w: linear_logprobs(h, w, tokens, temperature, with_entropy=True, chunk_rows=16),
                     hidden, weight, g_lp, g_ent)
    tol = tolerance(dtype, on_gpu=False)
    for what, o, r in zip(("logp", "entropy", "d hidden", "d weight"), out, ref):
        assert o.dtype == (torch.float32 if what in ("logp", "entropy") else dtype), what
        assert rel_err(o, r) < tol, (what, rel_err(o, r))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_gradients(dtype, monkeypatch):
    """d(hidden): the unfused backward's bits whatever the chunking. d(weight): the same bits run to run and
    however its vocabulary is sliced, close across chunkings, and (fp32, one chunk) the unfused bits."""
    n, temperature = 29, 0.7
    hidden, weight, tokens = _inputs(n, 64, dtype, seed=5)
    g_lp, g_ent = _upstream(n, seed=6)

    def fused(chunk):
        return lambda h, w: linear_logprobs(h, w, tokens, temperature, with_entropy=True, chunk_rows=chunk)

    def unfused(h, w):
        return token_logprobs_and_entropy(linear(h, w), tokens, temperature)

    with mode("invariant"):
        _, _, ref_dh, ref_dw = _grads(unfused, hidden, weight, g_lp, g_ent)
        _, _, dh10, dw10 = _grads(fused(10), hidden, weight, g_lp, g_ent)
        _, _, dh_all, dw_all = _grads(fused(n), hidden, weight, g_lp, g_ent)
        for chunk in (7, n + 5):  # a short last chunk; one chunk bigger than the batch
            assert torch.equal(_grads(fused(chunk), hidden, weight, g_lp, g_ent)[2], ref_dh), chunk
        monkeypatch.setattr(fused_module, "_DW_SLICE", 128)
        _, _, dh10b, dw10b = _grads(fused(10), hidden, weight, g_lp, g_ent)
    assert torch.equal(dh10, ref_dh) and torch.equal(dh_all, ref_dh) and torch.equal(dh10b, ref_dh)
    assert torch.equal(dw10b, dw10)
    assert rel_err(dw10, dw_all) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype == torch.float32:  # bf16: the kernel's cast truncates in the interpreter, torch's .to rounds
        assert torch.equal(dw_all, ref_dw)


def _main_grad_run(hidden, weight, tokens, g_lp, g_ent, chunk, start=None):
    """(d hidden, weight.grad, weight.main_grad) of one backward, weight a Parameter carrying `start` as its
    fp32 main_grad (None: none)."""
    h, w = hidden.clone().requires_grad_(True), torch.nn.Parameter(weight.clone())
    if start is not None:
        w.main_grad = start.clone()
    lp, ent = linear_logprobs(h, w, tokens, 0.7, with_entropy=True, chunk_rows=chunk)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return h.grad, w.grad, getattr(w, "main_grad", None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["invariant", "standard"])
def test_dweight_into_main_grad(name, dtype):
    """With an fp32 main_grad on the weight, d(weight) is added into it (no gradient returned), d(hidden) keeps
    its bits, and from zero main_grad holds the fp32 sum whose cast is the returned gradient without one."""
    n = 37
    hidden, weight, tokens = _inputs(n, 64, dtype, seed=13)
    g_lp, g_ent = _upstream(n, seed=14)
    start = torch.randn(weight.shape, generator=torch.Generator().manual_seed(15))
    _, _, _, ref_dw = _grads(lambda h, w: linear_logprobs_reference(h, w, tokens, 0.7),
                             hidden.double(), weight.double(), g_lp, g_ent)
    with mode(name):
        for chunk in (16, n):
            dh, dw, _ = _main_grad_run(hidden, weight, tokens, g_lp, g_ent, chunk)
            dh_mg, grad, main_grad = _main_grad_run(hidden, weight, tokens, g_lp, g_ent, chunk, start)
            assert grad is None and torch.equal(dh_mg, dh), chunk
            assert rel_err(main_grad - start, ref_dw) < tolerance(dtype, on_gpu=False), chunk
            zero_start = _main_grad_run(hidden, weight, tokens, g_lp, g_ent, chunk, torch.zeros_like(start))[2]
            assert torch.equal(zero_start.to(dtype), dw), chunk


@pytest.mark.parametrize("name", ["invariant", "standard"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_last_chunk_is_kept_for_the_backward(dtype, name, monkeypatch):
    """With a gradient to come, the last chunk's logits outlive the forward and the backward recomputes the other
    chunks only, dropping the kept one; the gradients are the bits a backward that recomputes every chunk gives
    (a second backward through the retained graph). Under no_grad no chunk outlives the forward."""
    n, chunk = 29, 8  # 4 chunks, the last short
    hidden, weight, tokens = _inputs(n, 64, dtype, seed=16)
    g_lp, g_ent = _upstream(n, seed=17)
    made = []

    def spy(h, w, inv_linear):
        out = real(h, w, inv_linear)
        made.append(weakref.ref(out))
        return out

    def alive():
        gc.collect()
        return [r() is not None for r in made]

    real = fused_module._logits
    monkeypatch.setattr(fused_module, "_logits", spy)
    with mode(name):
        with torch.no_grad():
            lp0, ent0 = linear_logprobs(hidden, weight.requires_grad_(True), tokens, 0.7, with_entropy=True,
                                        chunk_rows=chunk)
        weight.requires_grad_(False)
        assert len(made) == 4 and not any(alive())
        made.clear()
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = linear_logprobs(h, w, tokens, 0.7, with_entropy=True, chunk_rows=chunk)
        assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
        assert alive() == [False, False, False, True]
        loss = (lp * g_lp).sum() + (ent * g_ent).sum()
        first = torch.autograd.grad(loss, (h, w), retain_graph=True)
        assert len(made) == 4 + 3 and not any(alive())  # chunks 3, 2, 1 recomputed
        second = torch.autograd.grad(loss, (h, w))
        assert len(made) == 4 + 3 + 4
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("overrides", [{"linear": "standard"}, {"token_logprobs": "standard"}],
                         ids=["linear_standard", "logprobs_standard"])
def test_mixed_overrides_match_fp64(overrides):
    n, dtype, temperature = 37, torch.bfloat16, 0.7
    hidden, weight, tokens = _inputs(n, 64, dtype, seed=7)
    g_lp, g_ent = _upstream(n, seed=8)
    ref = _grads(lambda h, w: linear_logprobs_reference(h, w, tokens, temperature),
                 hidden.double(), weight.double(), g_lp, g_ent)
    with mode("invariant", **overrides):
        out = _grads(lambda h, w: linear_logprobs(h, w, tokens, temperature, with_entropy=True, chunk_rows=16),
                     hidden, weight, g_lp, g_ent)
    for what, o, r in zip(("logp", "entropy", "d hidden", "d weight"), out, ref):
        assert rel_err(o, r) < tolerance(dtype, on_gpu=False), (what, rel_err(o, r))


@pytest.mark.parametrize("forward_mode", ["standard", "invariant"])
def test_mode_is_captured_at_forward(forward_mode):
    """The backward runs the forward's path whatever mode is in force when it runs."""
    n = 21
    hidden, weight, tokens = _inputs(n, 64, torch.bfloat16, seed=9)
    g_lp, g_ent = _upstream(n, seed=10)
    other = "invariant" if forward_mode == "standard" else "standard"

    def grads(forward_in, backward_in):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with mode(forward_in):
            lp, ent = linear_logprobs(h, w, tokens, 0.7, with_entropy=True, chunk_rows=8)
        with mode(backward_in):
            return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (h, w))

    inside = grads(forward_mode, forward_mode)
    outside = grads(forward_mode, other)
    assert torch.equal(inside[0], outside[0]) and torch.equal(inside[1], outside[1])
    # The test has teeth: the other path gives other bits.
    assert not torch.equal(grads(other, other)[1], inside[1])


@pytest.mark.parametrize("name", ["invariant", "standard"])
def test_empty_batch(name):
    _, weight, _ = _inputs(1, 64, torch.bfloat16, seed=11)
    hidden = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    w = weight.clone().requires_grad_(True)
    with mode(name):
        lp, ent = linear_logprobs(hidden, w, torch.zeros(0, dtype=torch.int64), with_entropy=True)
    assert lp.shape == ent.shape == (0,) and lp.dtype == torch.float32
    dh, dw = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, w))
    assert dh.shape == (0, 64) and torch.equal(dw, torch.zeros_like(w))


def test_bad_inputs_raise_clear_errors():
    hidden, weight, tokens = _inputs(5, 64, torch.bfloat16, seed=12)
    cases = [
        ((hidden[:, :32], weight, tokens), {}, ValueError, "same H"),
        ((hidden[0], weight, tokens[:1]), {}, ValueError, r"hidden must be \[N, H\]"),
        ((hidden, weight, tokens[:4]), {}, ValueError, r"tokens must have shape \(5,\)"),
        ((hidden, weight, tokens[:, None]), {}, ValueError, "tokens must have shape"),
        ((hidden, weight, tokens.float()), {}, TypeError, "int64 or int32"),
        ((hidden, weight, tokens.tolist()), {}, TypeError, "int64 or int32"),
        ((hidden, weight.float(), tokens), {}, TypeError, "one dtype per call"),
        ((hidden.half(), weight.half(), tokens), {}, TypeError, "bfloat16 and torch.float32"),
        ((hidden, weight, tokens + V), {}, ValueError, r"token ids must lie in \[0, 600\)"),
        ((hidden, weight, tokens), {"temperature": 0}, ValueError, "temperature must be a positive"),
        ((hidden, weight, tokens), {"temperature": -1.0}, ValueError, "temperature must be a positive"),
        ((hidden, weight, tokens), {"chunk_rows": 0}, ValueError, "chunk_rows must be a positive int"),
        ((hidden, weight, tokens), {"chunk_rows": 2.0}, ValueError, "chunk_rows must be a positive int"),
    ]
    for args, kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            linear_logprobs(*args, **kwargs)

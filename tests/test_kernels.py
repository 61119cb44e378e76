"""Every op of the registry, on CPU through the Triton interpreter: accuracy vs
fp64, bitwise batch invariance, bitwise run-to-run determinism."""

from __future__ import annotations

import functools
import random
import zlib
from types import SimpleNamespace

import pytest
import torch

from helpers import check_against_fp64, forward_backward, pad_rows, rel_err, seed_for, take_rows, tolerance
from workbench.kernels import REGISTRY

OPS = sorted(REGISTRY)
DTYPES = [torch.float32, torch.bfloat16]
OP_DTYPES = [pytest.param(name, dtype, id=f"{name}-{dtype}") for name in OPS for dtype in REGISTRY[name].dtypes]


def _inputs(op, rows, dtype, seed):
    return op.make_inputs(rows, "small", torch.Generator().manual_seed(seed), "cpu", dtype)


@pytest.mark.parametrize("name, dtype", OP_DTYPES)
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


@pytest.mark.parametrize("name, dtype", OP_DTYPES)
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


@pytest.mark.parametrize("name", [n for n in OPS if set(REGISTRY[n].grad_args) & set(REGISTRY[n].row_args)])
def test_row_gradient_is_batch_invariant(name):
    """The gradient reaching a row's inputs does not depend on the other rows either."""
    op = REGISTRY[name]
    m, r = 13, 5
    args = _inputs(op, m, op.dtypes[-1], seed=3)
    one = take_rows(args, op.row_args, slice(r, r + 1))
    out_one, grads_one = forward_backward(op.invariant, one, op.grad_args)
    g_row = torch.randn(out_one.shape, generator=torch.Generator().manual_seed(7))
    g = torch.zeros((m, *out_one.shape[1:]))
    g[r : r + 1] = g_row
    _, grads = forward_backward(op.invariant, args, op.grad_args, upstream=g)
    for k, i in enumerate(op.grad_args):
        if i in op.row_args:
            assert torch.equal(grads[k][r : r + 1], grads_one[k]), f"{name}: grad of arg {i}"


@pytest.mark.parametrize("name, dtype", OP_DTYPES)
def test_forward_and_backward_are_deterministic(name, dtype):
    op = REGISTRY[name]
    args = _inputs(op, min(17, op.max_rows // 2), dtype, seed=5)
    out1, grads1 = forward_backward(op.invariant, args, op.grad_args)
    out2, grads2 = forward_backward(op.invariant, args, op.grad_args)
    assert torch.equal(out1, out2)
    for a, b in zip(grads1, grads2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name, dtype", [p for p in OP_DTYPES if REGISTRY[p.values[0]].unfused_fn])
def test_fused_op_gives_the_unfused_ops_bits(name, dtype):
    """Contract "the unfused ops' bits": the fused kernel equals its invariant ops run one after the other."""
    op = REGISTRY[name]
    args = _inputs(op, 7, dtype, seed=21)
    assert torch.equal(op.invariant(*args), op.unfused(*args)), f"{name}: not the unfused ops' bits"


@pytest.mark.parametrize("name", [n for n in OPS if REGISTRY[n].contract == "exact"])
def test_exact_op_gives_its_pytorch_forms_bits(name):
    op = REGISTRY[name]
    args = _inputs(op, 13, op.dtypes[-1], seed=22)
    assert torch.equal(op.invariant(*args), op.reference(*args)), f"{name}: not the PyTorch form's bits"


def test_registry_entries_resolve_and_the_docstring_table_is_the_registry():
    import pathlib

    import workbench.kernels as kernels
    from workbench.kernels.mode import OPS
    from workbench.kernels.registry import CONTRACTS, reference_name, resolve, table

    assert set(OPS) == {n for n, op in REGISTRY.items() if op.mode_switch}
    root = pathlib.Path(__file__).parent.parent
    for name, op in REGISTRY.items():
        assert op.contract in CONTRACTS, name
        assert callable(op.invariant) and callable(op.reference) and callable(resolve(reference_name(op)))
        assert (op.standard is not None) == bool(op.mode_switch or op.follows), name
        assert (root / "workbench" / "kernels" / f"{op.file}.py").exists(), name
        assert isinstance(op.tile_config(), dict)
        for t in op.tests:
            assert (root / t).exists(), f"{name}: test file {t} is missing"
    assert table() in kernels.__doc__, "kernels/__init__'s table differs from registry.table(): paste it again"


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
    """The TMA kernel (a GPU's default for aligned operands) in the three layouts of forward and backward:
    accurate, and the pointer kernel's bits (the interpreter's dot does not see the tiles' memory layout;
    tests/test_gpu.py checks the same on the GPU)."""
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
        assert torch.equal(out, matmul(a, b, tma=False))
    with pytest.raises(ValueError, match="tma=True needs"):
        matmul(torch.empty(21, 65, dtype=dtype)[:, :64], w.t(), tma=True)



def test_weight_gradient_accumulates_into_main_grad_in_fp32():
    """A weight carrying an fp32 `main_grad` (the trainer's master gradient) gets dW added to it inside the
    product, unrounded, over several backward passes, and no bf16 gradient; the TMA and pointer kernels
    agree; a wrong accumulator is refused by name."""
    from workbench.kernels.matmul import linear_invariant, matmul

    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 64, generator=g).bfloat16().requires_grad_(True)
    xs = [torch.randn(21, 64, generator=g).bfloat16() for _ in range(2)]
    dys = [torch.randn(21, 48, generator=g).bfloat16() for _ in range(2)]
    start = torch.randn(48, 64, generator=g)
    w.main_grad = start.clone()
    for x, dy in zip(xs, dys):
        linear_invariant(x, w).backward(dy)
    assert w.grad is None, "the gradient went to main_grad, not to a bf16 .grad"
    want = start.double() + sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))
    assert rel_err(w.main_grad, want) < 1e-5, f"seed {seed}: fp32 accumulation, no bf16 rounding of dW"
    acc_tma, acc_ptr = start.clone(), start.clone()
    matmul(dys[0].t(), xs[0], tma=True, accumulate=acc_tma)
    matmul(dys[0].t(), xs[0], tma=False, accumulate=acc_ptr)
    assert torch.equal(acc_tma, acc_ptr), f"seed {seed}"
    with pytest.raises(ValueError, match="accumulate"):
        matmul(dys[0].t(), xs[0], accumulate=start.bfloat16())

def test_logprobs_are_the_same_bits_with_or_without_the_entropy_sums():
    from workbench.kernels.logprobs import logprobs_and_entropy_invariant

    logits, tokens = _inputs(REGISTRY["token_logprobs"], 9, torch.bfloat16, seed=12)
    both = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=True)
    alone = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=False)
    assert torch.equal(both[0], alone[0]) and torch.isnan(alone[1]).all()


def _bias_linear_op():
    """`linear` with a bias (Qwen2's q/k/v projections), as the generic checks take an op."""
    from workbench.kernels.matmul import linear_invariant, linear_reference

    def make(rows, size, g, device, dtype):
        x, w = REGISTRY["linear"].make_inputs(rows, size, g, device, dtype)
        return x, w, (torch.randn(w.shape[0], generator=g) * 0.5).to(device=device, dtype=dtype)

    return SimpleNamespace(name="linear", invariant=linear_invariant, reference=linear_reference, make_inputs=make,
                           contract="row-invariant", row_args=(0,), grad_args=(0, 1, 2))


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


def _interpreter_dot_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as the interpreter's `dot_step` must compute it, in torch's elementwise fp32 ops: per BLOCK_K
    block (the K tail zero-filled), fp32 products summed pairwise, (2i, 2i+1) first, then added to acc."""
    from workbench.kernels.matmul_tiles import _INTERPRETER

    bk = _INTERPRETER.block_k
    pad = -a.shape[1] % bk
    af = torch.nn.functional.pad(a.float(), (0, pad))
    bf = torch.nn.functional.pad(b.float().t(), (0, pad))
    acc = torch.zeros(a.shape[0], b.shape[1])
    for s in range(0, af.shape[1], bk):
        p = af[:, None, s : s + bk] * bf[None, :, s : s + bk]
        while p.shape[2] > 1:
            p = p[..., 0::2] + p[..., 1::2]
        acc = acc + p[..., 0]
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_dot_is_a_fixed_order_fp32_sum_not_numpys_blas(dtype):
    """In the interpreter every tile's dot is explicit fp32 products summed in one fixed order: the bits are those
    of the reference sum above, whatever the tile, the memory layout or the kernel (pointer or TMA)."""
    from workbench.kernels.matmul import matmul

    g = torch.Generator().manual_seed(16)
    x = torch.randn(37, 96, generator=g).to(dtype)   # two row tiles, two K blocks (the second padded)
    w = torch.randn(300, 96, generator=g).to(dtype)  # two column tiles
    want = _interpreter_dot_reference(x, w.t())
    assert torch.equal(matmul(x, w.t(), out_dtype=torch.float32), want)
    assert torch.equal(matmul(x, w.t(), out_dtype=torch.float32, tma=True), want)
    # The backward's layouts: a transposed operand changes nothing.
    assert torch.equal(matmul(x.t().contiguous().t(), w.t(), out_dtype=torch.float32), want)


@functools.cache
def _blas_probe() -> tuple[list[str], str]:
    """Rows of the invariant linear (fp32, bf16) alone and in batches of several sizes, and attention's
    training forward against decode steps and against the sequence alone (forward and backward): the
    violations found, and a digest of every result. Run in this process and under other OpenBLAS kernels."""
    import hashlib

    from workbench.kernels import attention, attention_with_cache
    from workbench.kernels.matmul import linear_invariant

    bad, digest = [], hashlib.sha256()
    for dtype in DTYPES:
        g = torch.Generator().manual_seed(17)
        x = torch.randn(40, 96, generator=g).to(dtype)
        w = torch.randn(48, 96, generator=g).to(dtype)
        rows = [0, 5, 6, 15, 16, 17, 31, 32, 39]
        alone = {r: linear_invariant(x[r : r + 1], w) for r in rows}
        for m in (2, 6, 7, 17, 32, 33, 40):
            out = linear_invariant(x[:m], w)
            digest.update(out.float().numpy().tobytes())
            bad += [f"linear {dtype} row {r} of M={m}" for r in rows if r < m and not torch.equal(out[r], alone[r][0])]

        q, k, v = (torch.randn(2, 24, h, 16, generator=g).to(dtype).requires_grad_() for h in (2, 1, 1))
        up = torch.randn(2, 24, 2, 16, generator=g).to(dtype)
        train = attention(q, k, v)
        grads = torch.autograd.grad(train, (q, k, v), up)
        q1, k1, v1 = (t[1:].detach().requires_grad_() for t in (q, k, v))
        one = attention(q1, k1, v1)
        grads1 = torch.autograd.grad(one, (q1, k1, v1), up[1:])
        if not torch.equal(one[0], train[1]):
            bad.append(f"attention {dtype}: sequence 1 alone")
        bad += [f"attention {dtype}: grad {i} of sequence 1 alone" for i in range(3)
                if not torch.equal(grads1[i][0], grads[i][1])]
        with torch.no_grad():
            for p in (0, 5, 15, 16, 23):
                step = attention_with_cache(q[1:, p : p + 1], k[1:], v[1:], torch.tensor([p]), torch.tensor([p + 1]))
                if not torch.equal(step[0, 0], train[1, p]):
                    bad.append(f"attention {dtype}: decode at position {p}")
        for t in (train, *grads):
            digest.update(t.detach().float().numpy().tobytes())
    return bad, digest.hexdigest()


def test_rows_are_the_same_bits_alone_and_in_batches_of_any_size():
    """fp32 and bf16, linear and attention (forward and backward), through rows 16 and up of a tile, where
    OpenBLAS's Haswell kernel rounds differently (the interpreter's dot does not use it)."""
    bad, _ = _blas_probe()
    assert not bad, bad


_PROBE = """
import ctypes, glob, json, os, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
core = None
for lib in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename64_",
                 "openblas_get_corename"):
        fn = getattr(ctypes.CDLL(lib), name, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            core = fn().decode()
            break
# The control: does this BLAS kernel itself round a row by its place in a 32-row tile?
rng = np.random.default_rng(0)
a, b = rng.standard_normal((32, 64), dtype=np.float32), rng.standard_normal((64, 256), dtype=np.float32)
copies = np.matmul(np.repeat(a[:1], 32, 0), b)
from test_kernels import _blas_probe
bad, digest = _blas_probe()
print(json.dumps({"core": core, "blas_rows_differ": bool((copies != copies[0]).any()), "bad": bad, "digest": digest}))
"""


def test_interpreter_bits_do_not_follow_the_openblas_kernel():
    """The same bits under OpenBLAS's kernels for several CPUs (OPENBLAS_CORETYPE): numpy's matmul rounds
    differently per kernel (and, with Haswell's, per row position), the interpreter's dot never calls it."""
    import json
    import os
    import platform
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    if "openblas" not in str(blas.get("name", "")).lower() or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"numpy's BLAS is {blas.get('name')!r} on {platform.machine()}: OPENBLAS_CORETYPE means nothing")
    _, here = _blas_probe()
    # Haswell's kernel rounds rows 16 and up of a 32-row tile differently from rows 0-15; Sandybridge's gives
    # other bits again (so does Prescott's: the same as Sandybridge's on a Xeon here, so left out for time).
    cores = ("Haswell", "Sandybridge")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    procs = {c: subprocess.Popen([sys.executable, "-c", _PROBE, str(Path(__file__).parent)],
                                 env={**env, "OPENBLAS_CORETYPE": c}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for c in cores}
    ran, skipped = {}, []
    for c, p in procs.items():
        out, err = p.communicate(timeout=300)
        if p.returncode < 0:  # killed by a signal: an instruction set this CPU lacks
            skipped.append(f"{c} (signal {-p.returncode})")
            continue
        assert p.returncode == 0, f"OPENBLAS_CORETYPE={c}: {err[-3000:]}"
        res = json.loads(out.strip().splitlines()[-1])
        if res["core"] is not None and res["core"].lower() != c.lower():
            skipped.append(f"{c} (numpy's OpenBLAS ran {res['core']})")
            continue
        ran[c] = res
    if not ran:
        pytest.skip(f"no OPENBLAS_CORETYPE took effect: {skipped}")
    for c, res in ran.items():
        assert not res["bad"], f"OPENBLAS_CORETYPE={c}: {res['bad']}"
        assert res["digest"] == here, (f"OPENBLAS_CORETYPE={c} gives other bits than this process's BLAS "
                                       f"(its own matmul rounds rows by position: {res['blas_rows_differ']})")


def test_matmul_tiles_follow_m_on_hopper_only(monkeypatch):
    """The bf16 buckets (tiles by M) on sm90, whose MMA gives every bucket the same bits; one config for every M
    on any other GPU, so invariance there holds by construction. fp32: one config everywhere."""
    from workbench.kernels import matmul_tiles as mt

    monkeypatch.setattr(mt, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dev = torch.device("cuda", 0)
    ms = [1, 2, 17, 32, 33, 128, 129, 512, 513, 4096, 1 << 20]
    for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (10, 0), (12, 0)]:
        monkeypatch.setattr(mt, "_capability", lambda index, cap=cap: cap)
        cfgs = {mt.matmul_config(m, torch.bfloat16, dev) for m in ms}
        assert len(cfgs) == 1 and not cfgs.pop().persistent, cap
        assert len({mt.matmul_config(m, torch.float32, dev) for m in ms}) == 1
        cfg = mt.tile_config(dev)
        assert cfg["capability"] == f"sm{cap[0]}{cap[1]}" and "one config for every M" in cfg["bf16_rule"]
        assert "bf16_buckets" not in cfg and cfg["tma"] == (cap[0] >= 9)
    monkeypatch.setattr(mt, "_capability", lambda index: (9, 0))
    want = [next(c for top, c in mt.MATMUL_BUCKETS if m <= top) for m in ms]
    assert [mt.matmul_config(m, torch.bfloat16, dev) for m in ms] == want
    assert len(set(want)) == len(mt.MATMUL_BUCKETS)
    # Up to 512 rows, products wider than _WIDE_N columns (gate+up, the LM head) take the wide table.
    monkeypatch.setattr(mt, "_num_sms", lambda index: 132)
    wide = [next((c for top, c in mt.WIDE_BUCKETS if m <= top), w) for m, w in zip(ms, want)]
    assert [mt.matmul_config(m, torch.bfloat16, dev, n=151936) for m in ms] == wide
    small = [m for m in ms if m <= 512]
    assert [mt.matmul_config(m, torch.bfloat16, dev, n=mt._WIDE_N) for m in small] == want[:len(small)]
    # Decode products of 33-256 rows with at least 4M weights: the widest tile whose grid covers 7/8 of the 132
    # SMs in one wave (the Qwen3-1.7B shape's q+k+v, o and down); the bucket's where none does, or for smaller
    # products (SmolLM2's o, 576 x 576), or where K or N is unknown (0).
    qkv, o, down = (4096, 2048), (2048, 2048), (2048, 6144)
    widths = {(64, qkv): 32, (64, o): 16, (64, down): 16, (128, qkv): 64, (128, o): 32, (256, qkv): 128,
              (256, o): 64, (256, down): 64, (200, qkv): 128}
    assert {key: mt.matmul_config(key[0], torch.bfloat16, dev, *key[1]).block_n for key in widths} == widths
    for m, n, k in [(150, 4096, 2048), (64, 576, 576), (256, 960, 576), (64, 2048, 0), (64, 0, 2048),
                    (32, 4096, 2048), (257, 4096, 2048)]:
        assert mt.matmul_config(m, torch.bfloat16, dev, n, k) == next(c for top, c in mt.MATMUL_BUCKETS
                                                                       if m <= top), (m, n, k)
    assert len({mt.matmul_config(m, torch.float32, dev) for m in ms}) == 1
    cfg = mt.tile_config(dev)
    assert cfg["capability"] == "sm90" and cfg["bf16_buckets"] and cfg["tma"] and "buckets" in cfg["bf16_rule"]


def test_decode_weight_prefetch_is_chosen_by_shape_and_pdl_alone(monkeypatch):
    """How much of K a TMA program prefetches before its PDL wait: only under PDL, for a decode product (at most
    512 rows) of a bf16 weight read k-contiguous, a power of two up to the table's amount and within K; 0 when
    the amount is 0 (the A/B switch of the probe) or K is shorter than one 128-byte line."""
    from workbench.kernels import matmul as mm

    w = torch.zeros(8, 4096, dtype=torch.bfloat16).t()     # [K, N] read k-contiguous, as linear's weight.t()
    assert mm._prefetch_k(64, 4096, w, True, True) == mm._PREFETCH_K == 256
    assert mm._prefetch_k(512, 576, w, True, True) == 256 and mm._prefetch_k(64, 200, w, True, True) == 128
    assert mm._prefetch_k(64, 4096, w, True, False) == 0          # no PDL: nothing to overlap
    assert mm._prefetch_k(513, 4096, w, True, True) == 0          # a training product
    assert mm._prefetch_k(64, 4096, w.float(), True, True) == 0   # fp32: 64 elements are not one line
    assert mm._prefetch_k(64, 4096, w, False, True) == 0          # n-contiguous B
    assert mm._prefetch_k(64, 32, w, True, True) == 0
    monkeypatch.setattr(mm, "_PREFETCH_K", 0)
    assert mm._prefetch_k(64, 4096, w, True, True) == 0

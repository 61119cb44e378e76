"""The kernel library's claims on a real GPU, bitwise, at Qwen3-1.7B widths.

Run on the device with `bash scripts/gpu_check.sh` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

from helpers import check_against_fp64, forward_backward, pad_rows, take_rows
from workbench.kernels import REGISTRY

pytestmark = pytest.mark.gpu

OPS = sorted(REGISTRY)
DTYPES = [torch.float32, torch.bfloat16]
OP_DTYPES = [pytest.param(name, dtype, id=f"{name}-{dtype}") for name in OPS for dtype in REGISTRY[name].dtypes]
# Crosses every M bucket edge of the matmul (32/33, 128/129, 512/513).
MS = [1, 2, 3, 7, 17, 32, 33, 64, 128, 129, 300, 512, 513, 2048]


def _inputs(op, rows, dtype, seed):
    return op.make_inputs(rows, "real", torch.Generator().manual_seed(seed), "cuda", dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name, dtype", OP_DTYPES)
def test_gpu_accuracy_vs_fp64(name, dtype):
    op = REGISTRY[name]
    check_against_fp64(op, _inputs(op, 64, dtype, seed=1), on_gpu=True)


@pytest.mark.parametrize("name, dtype", OP_DTYPES)
def test_gpu_rows_bitwise_invariant_across_batch_sizes(name, dtype):
    """Every row of every M equals the same row computed alone; padding and position do not matter."""
    op = REGISTRY[name]
    ms = [m for m in MS if m <= op.max_rows_gpu]
    top = max(ms)
    big = _inputs(op, top, dtype, seed=2)
    alone = torch.cat([op.invariant(*take_rows(big, op.row_args, slice(r, r + 1))) for r in range(16)])
    for m in ms:
        out = op.invariant(*take_rows(big, op.row_args, slice(0, m)))
        k = min(m, 16)
        assert torch.equal(out[:k], alone[:k]), f"{name} {dtype}: rows differ at M={m}"
        # The same rows at another position, behind other rows.
        if m + 16 <= top:
            shifted = op.invariant(*take_rows(big, op.row_args, slice(top - m - 16, top)))
            assert torch.equal(shifted[-16:], op.invariant(*take_rows(big, op.row_args, slice(top - 16, top))))
    padded = op.invariant(*pad_rows(take_rows(big, op.row_args, slice(0, 16)), op.row_args, before=5, after=123))
    assert torch.equal(padded[5:21], alone)


@pytest.mark.parametrize("name", OPS)
def test_gpu_forward_backward_deterministic(name):
    op = REGISTRY[name]
    args = _inputs(op, min(1024, op.max_rows_gpu), op.dtypes[-1], seed=3)
    out1, g1 = forward_backward(op.invariant, args, op.grad_args)
    out2, g2 = forward_backward(op.invariant, args, op.grad_args)
    assert torch.equal(out1, out2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


def test_gpu_every_matmul_bucket_gives_the_same_bits():
    """The M buckets (and the wide products' ones) differ in tile shapes and BLOCK_K, TMA and pointer kernels
    in how tiles are loaded: forcing each onto the same rows changes no bit. Backward layouts too."""
    from workbench.kernels import matmul as mm
    from workbench.kernels import matmul_tiles as mt

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("MATMUL_BUCKETS apply on Hopper (sm90) alone; other GPUs take one config for every M")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(700, 2048, generator=g).cuda().bfloat16()
    w = (torch.randn(4096, 2048, generator=g) / 45).cuda().bfloat16()
    outs = []
    saved, saved_wide, saved_decode = mt.MATMUL_BUCKETS, mt.WIDE_BUCKETS, mt.DECODE_WIDTHS
    try:
        mt.WIDE_BUCKETS, mt.DECODE_WIDTHS = (), ()
        for cfg in [c for _, c in saved + saved_wide] + list(saved_decode) + [mt._FEW_TILES]:
            mt.MATMUL_BUCKETS = ((1 << 62, cfg),)
            outs.append(mm.matmul(x, w.t()))
            # The pointer kernel against the TMA kernel, in each bucket.
            outs.append(mm.matmul(x, w.t(), tma=False))
    finally:
        mt.MATMUL_BUCKETS, mt.WIDE_BUCKETS, mt.DECODE_WIDTHS = saved, saved_wide, saved_decode
    for cfg_out in outs[1:]:
        assert torch.equal(cfg_out, outs[0])
    dy = torch.randn(700, 4096, generator=g).cuda().bfloat16()
    assert torch.equal(mm.matmul(dy, w, tma=True), mm.matmul(dy, w, tma=False))
    assert torch.equal(mm.matmul(dy.t(), x, tma=True), mm.matmul(dy.t(), x, tma=False))
    # dW accumulated into an fp32 gradient (the trainer's main_grad), in the persistent bucket's tiles
    # ([4096, 2048]: 256 tiles) and in the few-tiles config ([1024, 2048]), TMA and pointer kernels alike.
    # One token (K = 1: a chunk of the LM head's dW that holds one completion token) too.
    for rows, tokens in ((4096, 700), (1024, 700), (4096, 1)):
        start = torch.randn(rows, 2048, generator=g).cuda()
        acc = [start.clone() for _ in range(2)]
        mm.matmul(dy[:tokens, :rows].t(), x[:tokens], tma=True, accumulate=acc[0])
        mm.matmul(dy[:tokens, :rows].t(), x[:tokens], tma=False, accumulate=acc[1])
        assert torch.equal(acc[0], acc[1])
        ref = start.double() + dy[:tokens, :rows].double().t() @ x[:tokens].double()
        assert ((acc[0].double() - ref).norm() / ref.norm()).item() < 1e-5
        if tokens == 1:  # one exact bf16 product added to C: one fp32 rounding, nothing else
            assert torch.equal(acc[0], start + dy[:1, :rows].float().t() * x[:1].float())


def test_gpu_negative_control_standard_linear_depends_on_batch_size():
    """cuBLAS in bf16: row 0 of x @ W.T changes with M for some M (the mismatch the workbench removes)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2048, 4096, generator=g).cuda().bfloat16()
    w = torch.randn(4096, 4096, generator=g).cuda().bfloat16()
    op = REGISTRY["linear"]
    one_std = op.standard(x[:1], w)
    one_inv = op.invariant(x[:1], w)
    differs = []
    for m in list(range(2, 65)) + [128, 256, 512, 1024, 2048]:
        if not torch.equal(op.standard(x[:m], w)[:1], one_std):
            differs.append(m)
        assert torch.equal(op.invariant(x[:m], w)[:1], one_inv)
    assert differs, "standard linear was batch invariant at every M tried: the control shows nothing"


def test_gpu_logprobs_same_bits_with_or_without_entropy():
    from workbench.kernels.logprobs import logprobs_and_entropy_invariant

    logits, tokens = _inputs(REGISTRY["token_logprobs"], 300, torch.bfloat16, seed=6)
    both = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=True)
    alone = logprobs_and_entropy_invariant(logits, tokens, 0.8, with_entropy=False)
    assert torch.equal(both[0], alone[0])


def test_gpu_linear_with_bias_rows_bitwise_invariant():
    """Qwen2-0.5B's q projection with its bias: every row equals itself alone, across the M buckets."""
    from workbench.kernels.matmul import linear_invariant, linear_reference

    g = torch.Generator().manual_seed(7)
    x = torch.randn(600, 896, generator=g).cuda().bfloat16()
    w = (torch.randn(896, 896, generator=g) / 30).cuda().bfloat16()
    b = torch.randn(896, generator=g).cuda().bfloat16()
    alone = torch.cat([linear_invariant(x[r : r + 1], w, b) for r in range(8)])
    for m in [*MS[:-1], 600]:
        k = min(m, 8)
        assert torch.equal(linear_invariant(x[:m], w, b)[:k], alone[:k]), f"bias linear rows differ at M={m}"
    ref = linear_reference(x, w, b)
    assert ((linear_invariant(x, w, b).double() - ref).norm() / ref.norm()).item() < 1e-2


def test_gpu_matmul_tiles_follow_m_on_hopper_only():
    """The bf16 tile config follows M (the buckets) on sm90 alone, where every bucket gives the same bits; any
    other GPU takes one config for every M. `tile_config` (the environment record) says which rule applies."""
    from workbench.kernels import matmul_tiles as mt

    major, minor = torch.cuda.get_device_capability()
    cfgs = {mt.matmul_config(m, torch.bfloat16) for m in MS}
    record = mt.tile_config()
    assert record["capability"] == f"sm{major}{minor}" and record["tma"] == (major >= 9)
    if major == 9:
        assert len(cfgs) == len(mt.MATMUL_BUCKETS) and "bf16_buckets" in record
    else:
        assert len(cfgs) == 1 and "bf16_buckets" not in record
    assert len({mt.matmul_config(m, torch.float32) for m in MS}) == 1


def test_gpu_attention_launches_past_65535_sequence_heads():
    """1,040 sequences x 64 query heads (8 KV heads) = 66,560 (sequence, head) programs, past the 65,535 that a
    grid's axes 1 and 2 allow: the training forward and backward, a prefill and a decode step against the static
    cache and a paged prefill and decode step all launch, and give the rows of a small batch (and of the training
    forward) bitwise."""
    from workbench.kernels import attention, attention_paged, attention_with_cache

    b, t, hq, hkv, d = 1040, 16, 64, 8, 64
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(b, t, hq, d, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(b, t, hkv, d, generator=g, device="cuda").bfloat16() for _ in range(2))
    up = torch.randn(b, t, hq, d, generator=g, device="cuda").bfloat16()
    lens = torch.randint(1, t + 1, (b,), generator=g, device="cuda", dtype=torch.int32)
    lens[[0, 1039]] = t
    # Sequences >= 1,024 hold the (sequence, head) indices past 65,535.
    pick = torch.tensor([0, 1, 517, 1023, 1024, 1030, 1039], device="cuda")

    big = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*big, lens)
    grads = torch.autograd.grad(out, big, up)
    small = [x[pick].clone().requires_grad_() for x in (q, k, v)]
    out_small = attention(*small, lens[pick])
    grads_small = torch.autograd.grad(out_small, small, up[pick])
    torch.cuda.synchronize()
    assert torch.equal(out[pick], out_small), "forward rows differ from the small batch"
    for name, gb, gs in zip(("dq", "dk", "dv"), grads, grads_small):
        assert torch.equal(gb[pick], gs), f"{name} rows differ from the small batch"
    out = out.detach()

    with torch.no_grad():
        zeros = torch.zeros(b, dtype=torch.int32, device="cuda")
        assert torch.equal(attention_with_cache(q, k, v, zeros, lens), out), "static-cache prefill"
        rows = torch.arange(b, device="cuda")
        last = (lens - 1).long()
        step = attention_with_cache(q[rows, last][:, None], k, v, lens - 1, lens)
        assert torch.equal(step[:, 0], out[rows, last]), "static-cache decode step"
        # Paged: sequence i's keys in page i (16 slots), its real tokens flattened.
        real = torch.arange(t, device="cuda")[None, :] < lens[:, None]
        cu_q = torch.cat([zeros[:1], lens.cumsum(0, dtype=torch.int32)])
        table = rows.to(torch.int32)[:, None]
        paged = attention_paged(q[real], k, v, table, cu_q, lens, t)
        assert torch.equal(paged, out[real]), "paged prefill"
        # A paged decode step (each sequence's last token; the decode kernel, 8 query heads per tile).
        paged = attention_paged(q[rows, last], k, v, table, torch.cat([zeros[:1], (rows + 1).to(torch.int32)]), lens, 1)
        assert torch.equal(paged, out[rows, last]), "paged decode step"

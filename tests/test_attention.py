"""The attention kernel's invariance triangle on CPU (interpreter): training forward == prefill == decode."""

import pytest
import torch

from workbench.kernels import attention, attention_paged, attention_with_cache, mode, paged_kv_write


@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 2), (2, 2)])   # decode: query heads packed per KV head, or not
def test_training_prefill_decode_bitwise_with_a_poisoned_cache(hq, hkv):
    g = torch.Generator().manual_seed(hq)
    b, t, d = 3, 21, 16
    q = torch.randn(b, t, hq, d, generator=g).bfloat16()
    k = torch.randn(b, t, hkv, d, generator=g).bfloat16()
    v = torch.randn(b, t, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([21, 6, 17], dtype=torch.int32)
    cache_k = torch.full((b, 40, hkv, d), float("nan")).bfloat16()
    cache_v = torch.full((b, 40, hkv, d), float("nan")).bfloat16()
    cache_k[:, :t], cache_v[:, :t] = k, v
    train = attention(q, k, v, lens)
    prefill = attention_with_cache(q, cache_k, cache_v, torch.zeros(b, dtype=torch.int32), lens)
    for i, n in enumerate(lens.tolist()):
        assert torch.equal(prefill[i, :n], train[i, :n])
        assert (train[i, n:] == 0).all(), "padding queries give zeros"
        for pos in range(n):
            one = attention_with_cache(q[i : i + 1, pos : pos + 1], cache_k[i : i + 1], cache_v[i : i + 1],
                                       torch.tensor([pos]), torch.tensor([pos + 1]))
            assert torch.equal(one[0, 0], train[i, pos]), f"sequence {i}, position {pos}"
    # One decode step of the whole batch, each sequence at its own last position.
    last = (lens - 1).long()
    step = attention_with_cache(q[torch.arange(b), last][:, None], cache_k, cache_v, lens - 1, lens)
    assert torch.equal(step[:, 0], train[torch.arange(b), last])
    # A chunked prefill: positions 8.. of sequence 0 as one step after the first 8.
    chunk = attention_with_cache(q[:1, 8:], cache_k[:1], cache_v[:1], torch.tensor([8]), torch.tensor([21]))
    assert torch.equal(chunk[0], train[0, 8:])


def test_standard_cache_path_matches_training_closely():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 9, h, 16, generator=g) for h in (4, 2, 2))
    lens = torch.tensor([9, 5], dtype=torch.int32)
    with mode("standard"):
        train = attention(q, k, v, lens)
        cached = attention_with_cache(q, k, v, torch.zeros(2, dtype=torch.int32), lens)
    assert torch.allclose(train, cached, atol=1e-6)


def _paged(k, v, lens, page_size, seed=0):
    """Every sequence's keys written into shuffled, NaN-poisoned pages by `paged_kv_write`."""
    from helpers import PagedSim

    sim = PagedSim(1, 16, page_size, k.shape[2], k.shape[3], dtype=k.dtype, seed=seed)
    for i, n in enumerate(lens.tolist()):
        _, _, cache = sim.step([(i, list(range(n)))])
        paged_kv_write(k[i, :n], v[i, :n], *sim.pages[0], cache.slots)
    return sim


@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_paged_attention_is_the_training_forward_bitwise(page_size):
    g = torch.Generator().manual_seed(2)
    b, t, hq, hkv, d = 3, 21, 4, 2, 16
    q = torch.randn(b, t, hq, d, generator=g).bfloat16()
    k = torch.randn(b, t, hkv, d, generator=g).bfloat16()
    v = torch.randn(b, t, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([21, 6, 17], dtype=torch.int32)
    train = attention(q, k, v, lens)
    sim = _paged(k, v, lens, page_size)
    kp, vp = sim.pages[0]
    table = torch.tensor([sim.tables[i] + [0] * (8 - len(sim.tables[i])) for i in range(b)], dtype=torch.int32)
    # One flattened prefill of all three sequences.
    flat = torch.cat([q[i, :n] for i, n in enumerate(lens.tolist())])
    cu = torch.tensor([0, 21, 27, 44], dtype=torch.int32)
    out = attention_paged(flat, kp, vp, table, cu, lens, 21)
    assert torch.equal(out, torch.cat([train[i, :n] for i, n in enumerate(lens.tolist())]))
    # Decode-like rows (one query each, at positions 13, 2, 16; the decode kernel, a KV head's query heads in one
    # tile) and, as vLLM pads a graph's batch, a request with no token and no keys and a row past cu_q[-1].
    pos = [13, 2, 16]
    rows = torch.cat([torch.stack([q[i, p] for i, p in enumerate(pos)]), torch.full((1, hq, d), float("nan"))])
    cu, kv = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32), torch.tensor(pos + [-1], dtype=torch.int32) + 1
    one = attention_paged(rows.bfloat16(), kp, vp, torch.cat([table, table[:1]]), cu, kv, 1)
    assert all(torch.equal(one[i], train[i, p]) for i, p in enumerate(pos))
    assert torch.equal(one[3], torch.zeros_like(one[3])), "a padded request's row stays zero"
    chunk = attention_paged(q[0, 8:], kp, vp, table[:1], torch.tensor([0, 13], dtype=torch.int32),
                            torch.tensor([21], dtype=torch.int32), 13)
    assert torch.equal(chunk, train[0, 8:])


def test_paged_attention_standard_mode_is_close_and_bad_input_is_named():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, h, 16, generator=g) for h in (4, 2, 2))
    lens = torch.tensor([9, 5], dtype=torch.int32)
    sim = _paged(k, v, lens, 4)
    kp, vp = sim.pages[0]
    table = torch.tensor([sim.tables[0], sim.tables[1] + [0]], dtype=torch.int32)
    flat = torch.cat([q[0], q[1, :5]])
    cu = torch.tensor([0, 9, 14], dtype=torch.int32)
    with mode("standard"):
        ref = attention(q, k, v, lens)
        out = attention_paged(flat, kp, vp, table, cu, lens, 9)
    assert torch.allclose(out, torch.cat([ref[0], ref[1, :5]]), atol=1e-6)
    with pytest.raises(ValueError, match="block_table"):
        attention_paged(flat, kp, vp, table[:1], cu, lens, 9)
    with pytest.raises(ValueError, match=r"\[tokens, Hq, D\]"):
        attention_paged(flat[None], kp, vp, table, cu, lens, 9)


def test_paged_edge_cases_padding_slots_idle_sequences_and_bad_metadata():
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(5, 2, 16, generator=g).bfloat16() for _ in range(2))
    kp, vp = (torch.full((3, 4, 2, 16), float("nan")).bfloat16() for _ in range(2))
    paged_kv_write(k, v, kp, vp, torch.tensor([6, -1, 0, 11, -1]))
    assert torch.equal(kp[1, 2], k[0]) and torch.equal(kp[0, 0], k[2]) and torch.equal(vp[2, 3], v[3])
    assert int(torch.isnan(kp).any(-1).any(-1).sum()) == 12 - 3, "padding slots (-1) write nothing"
    with pytest.raises(ValueError, match="past the 3 pages"):
        paged_kv_write(k, v, kp, vp, torch.tensor([12]))
    with pytest.raises(ValueError, match="1-D int tensor"):
        paged_kv_write(k, v, kp, vp, torch.tensor([0.0]))
    # A sequence with no new token in this step (cu_q repeats) is skipped; the other is served.
    q = torch.randn(2, 4, 16, generator=g).bfloat16()
    kp[2, :2], vp[2, :2] = k[3:5], v[3:5]
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    out = attention_paged(q, kp, vp, table, torch.tensor([0, 0, 2], dtype=torch.int32),
                          torch.tensor([3, 2], dtype=torch.int32), 2)
    one = attention_paged(q, kp, vp, table[1:], torch.tensor([0, 2], dtype=torch.int32),
                          torch.tensor([2], dtype=torch.int32), 2)
    assert torch.equal(out, one) and not torch.isnan(out).any()
    with pytest.raises(ValueError, match="at most its kv_len"):
        attention_paged(q, kp, vp, table[1:], torch.tensor([0, 2], dtype=torch.int32),
                        torch.tensor([1], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="`kv_len` must be a 1-D"):
        attention_paged(q, kp, vp, table, torch.tensor([0, 2], dtype=torch.int32), torch.tensor(3), 2)

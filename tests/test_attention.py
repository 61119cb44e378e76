"""The attention kernel's invariance triangle on CPU (interpreter): training forward == prefill == decode."""

import torch

from workbench.kernels import attention, attention_with_cache, mode


def test_training_prefill_decode_bitwise_with_a_poisoned_cache():
    g = torch.Generator().manual_seed(0)
    b, t, hq, hkv, d = 3, 21, 4, 2, 16
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

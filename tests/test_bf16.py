import pytest
import torch

from workbench import bf16


def test_hex_of_known_values():
    assert bf16.to_hex(torch.tensor([-0.625, 1.0, 0.0, -0.0]).bfloat16()) == ["bf20", "3f80", "0000", "8000"]
    assert bf16.to_hex(torch.tensor([1.0])) == ["3f800000"]
    assert int(bf16.bits(torch.tensor([-0.625]).bfloat16())) == 0xBF20


def test_round_to_bf16_is_round_to_nearest_even_like_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 20)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-45])
    # Exact ties: low half 0x8000, kept part even and odd.
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF], dtype=torch.int64)
    ties = torch.where(ties >= 2**31, ties - 2**32, ties).to(torch.int32).view(torch.float32)
    x = torch.cat([x, specials, ties])
    ours = bf16.round_to_bf16(x)
    assert torch.equal(ours.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert bf16.to_hex(bf16.round_to_bf16(ties[:2])) == ["3f80", "3f82"]
    assert torch.isnan(bf16.round_to_bf16(torch.tensor([float("nan")]))).all()


def test_truncation_differs_from_rounding_by_at_most_one_ulp():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    d = bf16.ulp_distance(bf16.truncate_to_bf16(x), bf16.round_to_bf16(x))
    assert d.max() == 1 and 0.3 < (d == 1).float().mean() < 0.7


def test_ulp_distance():
    a = torch.tensor([1.0, 1.0, -1.0, 0.0, 0.0, float("nan")]).bfloat16()
    b = torch.tensor([1.0, 1.0078125, -1.0078125, -0.0, 1e-40, 1.0]).bfloat16()
    assert bf16.ulp_distance(a, b).tolist() == [0, 1, 1, 0, int(bf16.bits(b[4:5])), -1]
    # Across zero: the smallest positive and negative subnormals are 2 apart.
    tiny = torch.tensor([1e-40, -1e-40]).bfloat16()
    assert bf16.ulp_distance(tiny[:1], tiny[1:]).item() == 2 * int(bf16.bits(tiny[:1]))
    with pytest.raises(TypeError, match="one dtype"):
        bf16.ulp_distance(a, b.float())


def test_neighbours_bracket_the_value():
    for v in (0.1, -3.3, 1000.7, 1.0):
        n = bf16.neighbours(v)
        assert n["below"] < n["bf16"] < n["above"]
        assert abs(n["rounding_error"]) <= n["ulp"] / 2
    assert bf16.neighbours(1.0)["ulp"] == 2**-7


def test_summation_order_changes_the_bf16_sum():
    rows = bf16.nonassociativity_demo(n=64, seed=0)
    sums = {r["order"]: r["sum"] for r in rows}
    assert len(set(sums.values())) > 1, "every order gave the same sum: the demo demonstrates nothing"
    assert all(r["hex"] == bf16.to_hex(torch.tensor([r["sum"]]).bfloat16())[0] for r in rows)


def test_split_count_changes_a_row_sum():
    """The mechanism behind batch variance: the same numbers, split differently, sum differently."""
    v = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    results = {k: bf16.split_sum(v, k).item() for k in (1, 2, 4, 8, 16)}
    assert len(set(results.values())) > 1

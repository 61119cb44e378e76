"""`swiglu_product`: the MLP's gate and up products and silu_mul in one kernel, the bits of the unfused ops in the
interpreter (fresh random inputs, the seed in the message); the GPU test holds it on the device."""

import pytest
import torch

from helpers import seed_for
from workbench.kernels import linear, mode, silu_mul, swiglu_product
from workbench.kernels.swiglu_product import swiglu_product_reference


def _rounding_bound(g: torch.Tensor, ref: torch.Tensor, device: str) -> torch.Tensor:
    """How far silu(g) * u may sit from its fp64 value after the kernel's four bf16 roundings (g, silu(g), u and
    the product), each off by at most r of its value: r = 2^-8 rounding to nearest on the GPU, 2^-7 in the
    interpreter, whose casts truncate. g's rounding reaches silu(g) scaled by silu's condition number
    |1 + g (1 - sigmoid(g))|; the fp32 sums over K add a few fp32 ulps (the small absolute term)."""
    r = 2.0**-8 if device == "cuda" else 2.0**-7
    kappa = (1 + g * (1 - torch.sigmoid(g))).abs()
    return ref.abs() * ((1 + r * kappa) * (1 + r) ** 3 - 1) + 1e-4


def check_swiglu_product(device, rows, k, inter):
    """The fused kernel against `silu_mul(linear(x, gate), linear(x, up))` in invariant mode, bitwise, and
    against the fp64 reference within its four roundings' bound; a row alone gives its bits in the batch."""
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
    gate_up = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(device=device, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2)
    with mode("invariant"):
        got = swiglu_product(x, gate_up)
        want = silu_mul(linear(x, gate), linear(x, up))
        alone = swiglu_product(x[rows // 2 : rows // 2 + 1], gate_up)
    assert got is not None and got.shape == (rows, inter), f"seed {seed}"
    assert torch.equal(got, want), f"seed {seed}: the fused product differs from the unfused ops"
    assert torch.equal(alone[0], got[rows // 2]), f"seed {seed}: a row alone differs from the same in the batch"
    ref = swiglu_product_reference(x, gate_up)
    gate_fp64 = (x.double() @ gate_up.double().t()).chunk(2, dim=-1)[0]
    excess = ((got.double() - ref).abs() - _rounding_bound(gate_fp64, ref, device)).max().item()
    assert excess <= 0, f"seed {seed}: the product is further from fp64 than its four bf16 roundings allow ({excess:.3g})"


@pytest.mark.parametrize("rows,k,inter", [(5, 96, 40), (33, 64, 320)], ids=["tails", "two-tiles"])
def test_fused_is_the_bits_of_the_unfused_ops(rows, k, inter):
    check_swiglu_product("cpu", rows, k, inter)


def test_where_it_does_not_apply_the_caller_is_told():
    x = torch.randn(3, 64).bfloat16()
    assert swiglu_product(x.float(), torch.randn(128, 64)) is None, "fp32: the unfused ops"
    assert swiglu_product(x, torch.randn(127, 64).bfloat16()) is None, "an odd row count is no gate/up pair"
    assert swiglu_product(x, torch.randn(128, 32).bfloat16()) is None, "K differs"

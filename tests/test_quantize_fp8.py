"""kernels/quantize_fp8.py: the fp8 sampler's activation quantization gives the ATen reference's codes and scales
bit for bit, edge rows included (zeros, a huge value, ties between e4m3 codes, subnormals), in the interpreter and
on a GPU; and the negative controls: the checks fail on the roundings the kernel avoids.

What the interpreter makes exact: its fp32 division is numpy's (IEEE, as `div_rn` on a GPU) and the kernel rounds
to e4m3 in fp32 arithmetic, so the whole contract is asserted on the CPU too. Its own fp32 -> float8e4nv cast is
not round-to-nearest-even (the first negative control), which is why the kernel does not round there."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from helpers import seed_for
from workbench.kernels import interpreting
from workbench.kernels.quantize_fp8 import FP8_MAX, quantize_fp8, quantize_fp8_reference, round_to_e4m3

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
WIDTHS = [576, 1536, 6144]          # SmolLM2-135M's hidden and intermediate, Qwen3-1.7B's intermediate
E4M3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 ... 448, no NaN
TIES = (E4M3[1:] + E4M3[:-1]) / 2   # every halfway point between neighbouring codes: exact in bf16


def _tie_row(k: int, scale: float) -> torch.Tensor:
    """Quotients exactly halfway between codes at a power-of-two scale (the row's amax is 448 * scale): the
    round-to-nearest-even cases, the carries into the next binade (15.5 -> 16) and the subnormals' ties."""
    row = torch.zeros(k)
    row[0] = FP8_MAX
    row[1:1 + len(TIES)], row[1 + len(TIES):1 + 2 * len(TIES)] = TIES, -TIES
    return row * scale


def _edge_rows(k: int, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(k, generator=g)
    huge = noise.clone()
    huge[k // 3] = torch.finfo(torch.bfloat16).max
    subnormal = noise * 2.0 ** -9      # quotients in e4m3's subnormal range beside one 448
    subnormal[5] = FP8_MAX
    return torch.stack([
        torch.zeros(k), -torch.zeros(k), huge, _tie_row(k, 1.0), _tie_row(k, 2.0 ** -20), _tie_row(k, 2.0 ** 40),
        subnormal, noise * 1e-39,       # bf16 subnormal inputs: the scale's floor, codes +-0
        noise * 1e-4,                   # at the scale's floor: quotients x * 448 * 512
    ]).bfloat16()


def _random_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    magnitude = 10.0 ** (torch.rand((m, 1), generator=g) * 14 - 9)
    return (torch.randn((m, k), generator=g) * magnitude).bfloat16()


def _assert_same_bits(x: torch.Tensor, what: str) -> None:
    codes, scale = quantize_fp8(x)
    want_codes, want_scale = quantize_fp8_reference(x.cpu())
    assert torch.equal(scale.cpu().view(torch.int32), want_scale.view(torch.int32)), f"{what}: scales differ"
    bad = (codes.cpu().view(torch.uint8) != want_codes.view(torch.uint8)).nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} codes differ, first at (row, col) {bad[0].tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", WIDTHS)
def test_codes_and_scales_are_the_references_bits(device, k):
    seed = seed_for(k)
    g = torch.Generator().manual_seed(seed)
    edges = _edge_rows(k, g)
    for i, row in enumerate(edges):                     # M = 1, each edge row alone
        _assert_same_bits(row[None].to(device), f"seed {seed}, K={k}, edge row {i} alone")
    x = _random_rows(64, k, g)                          # M = 64, the edge rows among random ones
    place = torch.randperm(64, generator=g)[:len(edges)]
    x[place] = edges
    _assert_same_bits(x.to(device), f"seed {seed}, K={k}, M=64, edge rows at {place.tolist()}")
    _assert_same_bits(x[:1].to(device), f"seed {seed}, K={k}, M=1")


@pytest.mark.parametrize("device", DEVICES)
def test_leading_dimensions_and_fp32_inputs(device):
    seed = seed_for()
    x = _random_rows(12, 576, torch.Generator().manual_seed(seed)).to(device)
    codes, scale = quantize_fp8(x.view(3, 4, 576))
    assert codes.shape == (12, 576) and scale.shape == (12, 1), f"seed {seed}"
    _assert_same_bits(x.float(), f"seed {seed}, fp32 input")


def test_the_tie_rows_catch_a_rounding_that_is_not_to_even():
    """Negative control of the checks themselves: rounding each tie away from zero (one fp32 ulp outward, then
    the reference's cast) changes codes the RTNE cast keeps, so the tie rows can fail a wrong rounding."""
    q = _tie_row(576, 1.0)
    outward = torch.nextafter(q, q * 2).to(torch.float8_e4m3fn)
    assert (outward.view(torch.uint8) != q.to(torch.float8_e4m3fn).view(torch.uint8)).sum() >= len(TIES)


@triton.jit
def _cast_kernel(q_ptr, out_ptr, N, ROUND_IN_FP32: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    q = tl.load(q_ptr + cols, mask=cols < N, other=0.0)
    if ROUND_IN_FP32:
        q = round_to_e4m3(q)
    tl.store(out_ptr + cols, q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True),
             mask=cols < N)


def _cast(q: torch.Tensor, round_in_fp32: bool) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.uint8, device=q.device)
    _cast_kernel[(1,)](q, out, q.numel(), ROUND_IN_FP32=round_in_fp32, BLOCK=triton.next_power_of_2(q.numel()))
    return out


@pytest.mark.skipif(not interpreting(), reason="the interpreter's cast; a GPU's cast rounds to nearest even")
def test_the_interpreters_own_cast_would_fail_the_checks():
    """Negative control: Triton's interpreter casting fp32 -> float8e4nv itself (no rounding in fp32 first) gives
    other codes on ties and carries, so the bitwise tests can fail; with `round_to_e4m3` first, the reference's."""
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    q = torch.cat([TIES, -TIES, torch.rand(512, generator=g) * FP8_MAX, torch.rand(64, generator=g) * 2.0 ** -6])
    want = q.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(_cast(q, round_in_fp32=True), want), f"seed {seed}"
    assert (_cast(q, round_in_fp32=False) != want).sum() > len(TIES), f"seed {seed}"


@triton.jit
def _divide_kernel(x_ptr, y_ptr, plain_ptr, rn_ptr, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x, y = tl.load(x_ptr + cols), tl.load(y_ptr + cols)
    tl.store(plain_ptr + cols, x / y)
    tl.store(rn_ptr + cols, tl.math.div_rn(x, y))


@pytest.mark.gpu
def test_gpu_plain_division_is_approximate_and_div_rn_is_torchs():
    """Negative control on the GPU: Triton's `/` on fp32 gives other bits than IEEE division on random operands,
    so the kernel's `div_rn` is what makes its scales and quotients the reference's."""
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(1 << 20, generator=g).cuda() for _ in range(2))
    plain, rn = torch.empty_like(x), torch.empty_like(x)
    _divide_kernel[(x.numel() // 1024,)](x, y, plain, rn, BLOCK=1024)
    assert torch.equal(rn.view(torch.int32), (x / y).view(torch.int32)), f"seed {seed}"
    assert (plain.view(torch.int32) != rn.view(torch.int32)).any(), f"seed {seed}"


@pytest.mark.gpu
def test_gpu_reference_is_the_cpu_reference_and_a_host_scalar_divisor_is_not():
    """The PyTorch form gives the contract's bits on a GPU too, which the exact-contract checks (tests/test_gpu.py)
    hold the kernel to there. Negative control: dividing by the Python number 448 on a GPU is ATen's product with
    the reciprocal, other scales for some rows."""
    seed = seed_for()
    x = _random_rows(4096, 576, torch.Generator().manual_seed(seed))
    codes, scale = quantize_fp8_reference(x.cuda())
    want_codes, want_scale = quantize_fp8_reference(x)
    assert torch.equal(scale.cpu().view(torch.int32), want_scale.view(torch.int32)), f"seed {seed}: scales differ"
    assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8)), f"seed {seed}: codes differ"
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    host_scalar = (amax.cuda() / FP8_MAX).cpu()
    assert (host_scalar.view(torch.int32) != (amax / FP8_MAX).view(torch.int32)).any(), f"seed {seed}"

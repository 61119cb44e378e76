"""bf16, bit by bit: the helpers the notebooks and parity reports use.

bf16 is the top half of an fp32: 1 sign bit, 8 exponent bits, 7 mantissa
bits. So a bf16 number's bits are 4 hex digits (-0.625 is `bf20`), an fp32's
are 8, and one bf16 ulp is 2**-7 relative to the leading power of two.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

_INT_VIEW = {
    torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64,
}
_HEX_DIGITS = {torch.bfloat16: 4, torch.float16: 4, torch.float32: 8, torch.float64: 16}


def _int_view(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _INT_VIEW:
        raise TypeError(f"expected a bf16, fp16, fp32 or fp64 tensor, got {t.dtype}")
    return t.contiguous().view(_INT_VIEW[t.dtype])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns as non-negative int64 (e.g. 0xbf20 for bf16 -0.625)."""
    width = 4 * _HEX_DIGITS[t.dtype]
    i = _int_view(t).to(torch.int64)
    return i & ((1 << width) - 1) if width < 64 else i


def to_hex(t: torch.Tensor) -> list[str]:
    """Each element's bits as fixed-width lower-case hex, flattened: bf16 -0.625 -> 'bf20'."""
    digits = _HEX_DIGITS.get(t.dtype)
    if digits is None:
        raise TypeError(f"expected a bf16, fp16, fp32 or fp64 tensor, got {t.dtype}")
    raw = _int_view(t).flatten().tolist()
    mask = (1 << (4 * digits)) - 1
    return [format(v & mask, f"0{digits}x") for v in raw]


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that consecutive floats are consecutive integers (+0 and -0 both 0)."""
    i = _int_view(t).to(torch.int64)
    sign_min = -(1 << (4 * _HEX_DIGITS[t.dtype] - 1))
    return torch.where(i < 0, sign_min - i, i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values apart a and b are, elementwise (int64); -1 where either is NaN."""
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs one dtype, got {a.dtype} and {b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"ulp_distance needs one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    d = (_ordered(a) - _ordered(b)).abs()
    return torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(d, -1), d)


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with round-to-nearest-even, in integer arithmetic (equals `x.to(torch.bfloat16)`).

    Add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: a tie
    (low half exactly 0x8000) rounds up only when the kept part is odd.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_bf16 takes fp32, got {x.dtype}")
    i = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    lsb = (i >> 16) & 1
    rounded = ((i + 0x7FFF + lsb) >> 16) & 0xFFFF
    # NaN must stay NaN: keep its top half and force a mantissa bit (quiet NaN).
    rounded = torch.where(torch.isnan(x), (i >> 16) | 0x40, rounded)
    return _from_bits16(rounded)


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (round toward zero), as Triton's CPU interpreter does."""
    if x.dtype != torch.float32:
        raise TypeError(f"truncate_to_bf16 takes fp32, got {x.dtype}")
    i = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return _from_bits16(i >> 16)


def _from_bits16(u: torch.Tensor) -> torch.Tensor:
    signed = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
    return signed.view(torch.bfloat16)


def neighbours(value: float) -> dict[str, float]:
    """A value's bf16 rounding and the bf16 numbers on either side of it."""
    x = torch.tensor([value], dtype=torch.float32)
    b = round_to_bf16(x)
    i = _int_view(b).to(torch.int64)
    below, above = _from_bits16((i - 1) & 0xFFFF), _from_bits16((i + 1) & 0xFFFF)
    if value < 0:
        below, above = above, below
    return {
        "value": float(x),
        "bf16": float(b.float()),
        "hex": to_hex(b)[0],
        "below": float(below.float()),
        "above": float(above.float()),
        "ulp": float(above.float()) - float(b.float()) if value >= 0 else float(b.float()) - float(below.float()),
        "rounding_error": float(b.float()) - float(x),
    }


def sum_in_order(values: Sequence[float] | torch.Tensor, order: Sequence[int] | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Sum one by one in `order`, rounding the running sum to `dtype` after every addition."""
    v = torch.as_tensor(values, dtype=torch.float32).flatten()
    idx = range(len(v)) if order is None else order
    acc = torch.zeros((), dtype=dtype)
    for i in idx:
        acc = (acc.float() + v[i].to(dtype).float()).to(dtype)
    return acc


def split_sum(values: Sequence[float] | torch.Tensor, n_splits: int,
              dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Split-K style: sum `n_splits` contiguous chunks separately, then add the partial sums.

    A library that picks n_splits from the batch size (as cuBLAS picks split-K)
    gives a row different bits in different batches: the source of the mismatch.
    """
    v = torch.as_tensor(values, dtype=torch.float32).flatten()
    parts = [sum_in_order(chunk, dtype=dtype) for chunk in torch.tensor_split(v, n_splits)]
    return sum_in_order(torch.stack([p.float() for p in parts]), dtype=dtype)


def nonassociativity_demo(n: int = 64, seed: int = 0) -> list[dict]:
    """The same n numbers summed in different orders, with a bf16 running sum: different results.

    Returns rows {order, sum, hex, error_vs_exact} (the exact sum is in fp64).
    """
    rng = random.Random(seed)
    values = [rng.gauss(0.0, 1.0) * 10 ** rng.uniform(-2, 2) for _ in range(n)]
    v16 = torch.tensor(values).to(torch.bfloat16)
    exact = float(v16.double().sum())
    orders = {
        "left to right": list(range(n)),
        "right to left": list(range(n - 1, -1, -1)),
        "smallest first": sorted(range(n), key=lambda i: abs(values[i])),
        "largest first": sorted(range(n), key=lambda i: -abs(values[i])),
        "shuffled": rng.sample(range(n), n),
    }
    rows = []
    for name, order in orders.items():
        s = sum_in_order(v16.float(), order)
        rows.append({"order": name, "sum": float(s.float()), "hex": to_hex(s.reshape(1))[0],
                     "error_vs_exact": float(s.float()) - exact})
    for k in (2, 4, 8):
        s = split_sum(v16.float(), k)
        rows.append({"order": f"{k} splits, then combined", "sum": float(s.float()), "hex": to_hex(s.reshape(1))[0],
                     "error_vs_exact": float(s.float()) - exact})
    return rows

"""The invariant matmul's tile configs: which tiles a product of M rows (N columns, depth K) takes on which GPU.

Why a choice here can never move a bit is `matmul.py`'s numerics contract: on Hopper a tile's chain of k-steps
does not depend on its M/N tiles (every entry is checked bitwise against the others, `tests/test_gpu.py`), so the
tiles may follow the product's shape there; every other GPU, fp32 and the interpreter take one config for every M.
The tables are fixed (no run-time autotuning); `tools/tune/tune_matmul.py` measures them, and BENCHMARKS.md ("Numbers
behind the code") keeps the measurements that chose them.

Bits contract on what shares the GPU: a choice here is a function of the product's shape, its dtype, the device's
compute capability and `PINNED_SMS`, never of the SMs this process sees. Under CUDA MPS with
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE a process sees a share of them (25%: 32 of an H200's 132), and bits measured on
the H200 changed with the share while the decode widths followed that count (issue 59). Where a choice is sized
to fill the GPU it is sized for PINNED_SMS; only a persistent kernel's grid (how many programs share out the
tiles, `matmul.py`) follows the visible count, and which program computes a tile moves no bit. That alone did not
keep an invariant generation's bits under a 25% share on the H200 (something outside these rules follows the
SMs), so invariant mode refuses a capped share (`mode._check_whole_gpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton

from .runtime import interpreting


PINNED_SMS = 132
"""The SM count every tile choice is sized for: an H100 SXM's and an H200's (the GPUs the tables were measured on).
On a GPU with other SMs (an H100 PCIe's 114, a capped MPS share) the choices stay those of 132 SMs: maybe slower
there, the same bits everywhere."""


@dataclass(frozen=True)
class MatmulConfig:
    """One tile config of the invariant matmul's kernels."""

    block_m: int
    """Rows of an output tile."""
    block_n: int
    """Columns of an output tile."""
    block_k: int
    """Depth of one k-step. The interpreter's fixed-order sum follows its blocks; Hopper's MMA chain does not."""
    group_m: int = 8
    """Row tiles walked together (L2 reuse of the weights' tiles); the launch order only."""
    num_warps: int = 4
    """Warps a program."""
    num_stages: int = 3
    """K blocks loaded ahead."""
    persistent: bool = False
    """One program per SM looping over tiles (TMA path only)."""


# Interpreter: its cost is per interpreted program step, not per flop, so wide N/K tiles (a real model's
# lm_head: 1,728 interpreted steps instead of 27,648 with 32x32x32 tiles); BLOCK_K 64 keeps the tests' K = 96
# accumulating over two blocks. Fixed, never a function of M: every row goes through the same shapes.
_INTERPRETER = MatmulConfig(32, 256, 64, group_m=4, num_warps=4, num_stages=1)

# GPU, bf16: (largest M of the bucket, config), chosen by `tools/tune/tune_matmul.py`
# on an H200. Every candidate config (BLOCK_K 64 or 128, any M/N tiles, warps,
# stages, persistent or not, TMA or pointer loads) gave the same bits on every
# row: on Hopper a dot over a K block is a chain of k=16 MMA steps in
# increasing k, whatever the tiling. That is what lets the tiles follow M, on
# Hopper alone (`matmul_config` reads the device's capability; other GPUs take
# `_BF16_ONE`); tests/test_gpu.py checks it again for these buckets. The three decode buckets (M <= 512) were
# re-chosen on an H100 by `tune_matmul.py --decode-tiles` (46 tile configs with BLOCK_K up to 256, every one of
# them the table's bits), per bucket the best for the 1.7B shape's q+k+v, o and down products together
# (BENCHMARKS.md, "Numbers behind the code"); the 256-row entries on an H200 by `--decode-tiles 256`, where the
# 512-row bucket's tiles had been the compromise between 256 and 512 rows.
MATMUL_BUCKETS: tuple[tuple[int, MatmulConfig], ...] = (
    (32, MatmulConfig(16, 64, 256, group_m=8, num_warps=4, num_stages=4)),
    (256, MatmulConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=6)),
    (512, MatmulConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4)),
    (1 << 62, MatmulConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True)),
)
# Hopper, bf16, a decode bucket's products wider than `_WIDE_N` columns (gate+up, the LM head): wider tiles win
# there (same measurement, BENCHMARKS.md, "Numbers behind the code"). Same chain of k-steps, so the same bits (tests/test_gpu.py).
_WIDE_N = 4096
WIDE_BUCKETS: tuple[tuple[int, MatmulConfig], ...] = (
    (32, MatmulConfig(32, 128, 128, group_m=8, num_warps=4, num_stages=4)),
    (128, MatmulConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4)),
    (256, MatmulConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, persistent=True)),
    (512, MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, persistent=True)),
)
# Hopper, bf16, a decode product of 33-256 rows, at most `_WIDE_N` columns and at least `_DECODE_MIN_WEIGHTS`
# weights (the Qwen3-1.7B shape's q+k+v, o and down): reading its weights is its cost, and one tile for every
# product of a bucket leaves SMs idle for the narrow ones (o at 64 rows: 32 tiles of 64 x 64 on 132 SMs) and spills
# a short second wave for the wide ones (q+k+v at 256 rows: 256 tiles). So the product takes the widest of these
# tiles whose grid covers 7/8 of the SMs in one wave, the bucket's where none does: per product, the fastest tile
# `tune_matmul.py --decode-tiles` found at 64, 128 and 256 rows. Smaller products (SmolLM2-135M's) are
# latency-bound and measured slower under the rule without its weight floor and one-wave cap, so they keep the
# bucket's (BENCHMARKS.md, "Numbers behind the code"). Same chain of k-steps, so the same bits (tests/test_gpu.py).
DECODE_WIDTHS: tuple[MatmulConfig, ...] = (
    MatmulConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4),
    MatmulConfig(64, 64, 128, group_m=8, num_warps=4, num_stages=6),
    MatmulConfig(64, 32, 256, group_m=8, num_warps=4, num_stages=4),
    MatmulConfig(64, 16, 256, group_m=8, num_warps=4, num_stages=4),
)
_DECODE_ROWS = (33, 256)
_DECODE_MIN_WEIGHTS = 1 << 22
# Hopper, bf16, where the bucket's tiles would number fewer than the SMs (the weight gradient of a narrow
# projection: Qwen3-1.7B's k/v dW is [1024, 2048], 64 tiles of 128 x 256 on 132 SMs, 1.75x cuBLAS's time).
# Same chain of k-steps, so the same bits as the buckets (checked with them in tests/test_gpu.py).
_FEW_TILES = MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4)
# Hopper, bf16, many rows and at most 32 columns (a LoRA adapter's [tokens, r] products): the bucket's 256
# columns would be 8-16x wasted MMA work. Same chain of k-steps, so the same bits (tests/test_gpu_lora.py
# compares the generator's decode, in the small buckets, with the trainer's rows here).
_NARROW_N = MatmulConfig(128, 32, 64, group_m=8, num_warps=4, num_stages=4)
# GPU, bf16, any architecture but Hopper: one config for every M, so a row's chain of k-steps cannot
# depend on M whatever the tensor cores do (the buckets' equality was measured on Hopper only). Not
# persistent, and small enough in shared memory (3 stages of 64x64 + 64x128 bf16: 72 KiB) for the
# ~100 KiB of an sm86/sm89/sm120 card. Not tuned.
_BF16_ONE = MatmulConfig(64, 128, 64, group_m=8, num_warps=4, num_stages=3)
# GPU, fp32 (IEEE dot, FMA units): one config for every M.
_FP32 = MatmulConfig(64, 64, 32, group_m=8, num_warps=4, num_stages=2)


@cache
def _capability(device_index: int) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, read once per device."""
    return tuple(torch.cuda.get_device_capability(device_index))


def _device_index(device: torch.device | None) -> int:
    index = device.index if device is not None and device.index is not None else None
    return torch.cuda.current_device() if index is None else index


def _device_capability(device: torch.device | None) -> tuple[int, int]:
    return _capability(_device_index(device))


def _uses_buckets(capability: tuple[int, int]) -> bool:
    """Whether the bf16 tile config may follow M: on Hopper (sm90) alone, where it was measured bitwise."""
    return capability[0] == 9


def matmul_config(m: int, dtype: torch.dtype, device: torch.device | None = None, n: int = 0,
                  k: int = 0) -> MatmulConfig:
    """The tile config for a product with `m` rows (and `n` columns and depth `k`, 0: unknown) on `device` (a
    CUDA device; None: the current one).

    A fixed table. bf16 on Hopper: `MATMUL_BUCKETS` by M (`WIDE_BUCKETS` for up to 512 rows and more than
    `_WIDE_N` columns; `DECODE_WIDTHS` by the grid's size for 33-256 rows, up to `_WIDE_N` columns and at least
    `_DECODE_MIN_WEIGHTS` weights),
    `_NARROW_N` for at most 32 columns, or
    `_FEW_TILES` where the bucket's tiles would leave SMs idle (every entry gives the same bits there); on
    any other GPU: one config for every M. fp32 and the interpreter: one config for every M.
    """
    if interpreting():
        return _INTERPRETER
    if dtype == torch.float32:
        return _FP32
    if not _uses_buckets(_device_capability(device)):
        return _BF16_ONE
    for max_m, cfg in (WIDE_BUCKETS if n > _WIDE_N else ()) + MATMUL_BUCKETS:
        if m <= max_m:
            break
    return _hopper_bf16(m, n, k, cfg, PINNED_SMS)


def _hopper_bf16(m: int, n: int, k: int, cfg: MatmulConfig, sms: int) -> MatmulConfig:
    """The Hopper bf16 choice from the bucket's `cfg`, for a GPU of `sms` SMs (`matmul_config`: PINNED_SMS)."""
    if _DECODE_ROWS[0] <= m <= _DECODE_ROWS[1] and 0 < n <= _WIDE_N and n * k >= _DECODE_MIN_WEIGHTS:
        for c in DECODE_WIDTHS:
            if 7 * sms <= 8 * triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n) <= 8 * sms:
                return c
    if cfg.persistent and 0 < n <= _NARROW_N.block_n:
        return _NARROW_N
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    if cfg.persistent and 0 < tiles < sms:
        return _FEW_TILES
    return cfg


def tile_config(device: torch.device | None = None) -> dict:
    """The tile configs in force here (for the environment record), and which rule picks them."""
    if interpreting():
        return {"interpreter": vars(_INTERPRETER)}
    if not torch.cuda.is_available():
        return {"no_gpu": "the invariant matmul runs on CUDA or in the interpreter"}
    major, minor = _device_capability(device)
    out = {"capability": f"sm{major}{minor}", "fp32": vars(_FP32), "tma": major >= 9}
    if _uses_buckets((major, minor)):
        out["bf16_rule"] = "buckets by M (Hopper: the buckets give the same bits, checked by tests/test_gpu.py)"
        out["bf16_buckets"] = [(m, vars(c)) for m, c in MATMUL_BUCKETS]
        out["bf16_wide_buckets"] = {"columns_over": _WIDE_N, "buckets": [(m, vars(c)) for m, c in WIDE_BUCKETS]}
        out["bf16_decode_widths"] = {"rows": list(_DECODE_ROWS), "columns_up_to": _WIDE_N,
                                     "weights_from": _DECODE_MIN_WEIGHTS,
                                     "widest_covering_7_8_of_the_sms_in_one_wave": [vars(c) for c in DECODE_WIDTHS]}
        out["bf16_few_tiles"] = vars(_FEW_TILES)
        out["bf16_narrow_n"] = vars(_NARROW_N)
        out["sms_the_choices_are_sized_for"] = PINNED_SMS
    else:
        out["bf16_rule"] = "one config for every M (not Hopper: no bucket was measured here)"
        out["bf16"] = vars(_BF16_ONE)
    return out


@cache
def _num_sms(device_index: int) -> int:
    """The SMs this process sees: a persistent grid's size, never a choice of arithmetic (PINNED_SMS)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count

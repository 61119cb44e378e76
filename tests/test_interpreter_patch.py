"""tests/interpreter_patch.py's shortcut for Triton's interpreted float conversion gives Triton's own bits: every
bf16 pattern up, and down every fp32 sign, exponent and 7 high mantissa bits with low halves that truncation must
drop; a block holding a subnormal, a rounding downcast and the other conversions are left to Triton; any shape."""

import os
import subprocess
import sys

import numpy as np
import pytest

interp = pytest.importorskip("triton.runtime.interpreter")
from interpreter_patch import fast_convert_float  # noqa: E402

from helpers import seed_for


def _triton_convert():
    """Triton's own `_convert_float` (where the speed-up is installed, the shortcut holds it)."""
    return getattr(interp._convert_float, "triton", interp._convert_float)


def _subnormal(bits: np.ndarray, mantissa_bits: int) -> np.ndarray:
    magnitude = bits & ((1 << (8 * bits.itemsize - 1)) - 1)
    return (magnitude > 0) & (magnitude < (1 << mantissa_bits))


def test_the_shortcut_is_tritons_conversion_bit_for_bit():
    tl, triton_convert, rtne = interp.tl, _triton_convert(), interp._ir.ROUNDING_MODE.RTNE
    left_to_triton = []

    def counted(*args):
        left_to_triton.append(args[1:])
        return triton_convert(*args)

    fast = fast_convert_float(counted, tl)
    seed = seed_for(bound=2**32)
    low = np.array([0, 1, 0x7FFF, 0x8000, 0xFFFF, *np.random.default_rng(seed).integers(0, 1 << 16, 3)], np.uint32)
    bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    fp32 = ((bf16.astype(np.uint32)[:, None] << 16) | low).ravel()
    bf16_normal, fp32_normal = bf16[~_subnormal(bf16, 7)], fp32[~_subnormal(fp32, 23)]
    shortcut = [(bf16_normal, tl.bfloat16, tl.float32, None), (bf16_normal, tl.bfloat16, tl.float32, rtne),
                (fp32_normal.view(np.float32), tl.float32, tl.bfloat16, None),
                (bf16_normal[:4096].reshape(64, 64).T, tl.bfloat16, tl.float32, None),   # a transposed view
                (np.array(np.float32(-1.5)), tl.float32, tl.bfloat16, None)]            # a scalar
    triton = [(bf16, tl.bfloat16, tl.float32, None), (fp32.view(np.float32), tl.float32, tl.bfloat16, None),
              (fp32_normal.view(np.float32), tl.float32, tl.bfloat16, rtne),
              (np.array([1.0, 2.0], np.float32), tl.float32, tl.float16, None)]
    for i, (data, src, dst, rounding) in enumerate(shortcut + triton):
        want, got = triton_convert(data, src, dst, rounding), fast(data, src, dst, rounding)
        assert got.dtype == want.dtype and got.shape == want.shape, (src, dst, data.shape)
        assert np.array_equal(got, want), f"seed {seed}: {src} -> {dst}, {data.shape}, rounding {rounding}"
        assert len(left_to_triton) == max(0, i + 1 - len(shortcut)), f"case {i}: the shortcut or Triton, as planned"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("WORKBENCH_PLAIN_INTERPRETER") == "1",
                    reason="the speed-up is installed under the interpreter only")
def test_a_started_process_has_the_shortcut():
    """tests/subprocess_site installs the speed-up while `import triton` is still importing triton.language."""
    code = ("import triton, numpy as np; from triton.runtime import interpreter as i\n"
            "assert i._convert_float.__name__ == 'convert_float'\n"
            "one_and_a_half = np.array([0x3FC0], np.uint16)\n"
            "assert i._convert_float(one_and_a_half, i.tl.bfloat16, i.tl.float32, None)[0] == 0x3FC00000")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]

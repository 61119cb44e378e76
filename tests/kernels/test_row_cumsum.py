"""row_cumsum, top-p's prefix sums in one fixed order: accurate against fp64 and row-invariant (a row's sums are
the same bits alone, in a batch, or beside padding), on CPU (the interpreter) and on a GPU. The negative control:
torch.cumsum on the GPU is not held to this."""

from __future__ import annotations

import pytest
import torch

from helpers import seed_for
from workbench.kernels import row_cumsum
from workbench.kernels.cumsum import row_cumsum_reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("width", [700, 151936])
@pytest.mark.parametrize("device", DEVICES)
def test_row_cumsum_is_accurate_and_batch_invariant(device, width):
    if device == "cpu" and width > 10_000:
        pytest.skip("a vocabulary-wide row is the GPU's case (seconds in the interpreter)")
    seed = seed_for()
    x = torch.rand(9, width, generator=torch.Generator().manual_seed(seed)).to(device)
    y = row_cumsum(x)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), row_cumsum_reference(x), rtol=1e-5), f"seed {seed}"
    assert torch.equal(row_cumsum(x[4:5]), y[4:5]), f"seed {seed}: a row alone"
    padded = torch.cat([torch.zeros(2, width, device=device), x[4:5], torch.zeros(3, width, device=device)])
    assert torch.equal(row_cumsum(padded)[2:3], y[4:5]), f"seed {seed}: a row beside padding"
    assert torch.equal(row_cumsum(x.bfloat16())[4:5], row_cumsum(x[4:5].bfloat16())), f"seed {seed}: bf16"

"""The parity audit on a real GPU (skipped without CUDA): invariant is bitwise everywhere, standard
is not, and the first divergence is localised to the op put in standard mode.

Measured on an H100 (2026-11-22): at the registry's linear shape (K=2048) cuBLAS happened to give a row
the same bits alone and in a batch, and SDPA's decode matched its training forward at T=64; the
model-level negative control (cuBLAS at K=6144 in down_proj) is the one that must fail."""

import pytest
import torch

from workbench.kernels import REGISTRY
from workbench.models import build
from workbench.teach.audit import AUDIT_FULL, divergence_sweep, kernel_audit

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_gpu_kernel_audit_invariant_bitwise_standard_not():
    table = kernel_audit(device="cuda", **AUDIT_FULL)
    inv, std = table[table["mode"] == "invariant"], table[table["mode"] == "standard"]
    assert inv.bitwise_equal.all(), inv[~inv.bitwise_equal].to_string()
    assert (inv.max_ulp == 0).all()
    assert set(inv.op) == set(REGISTRY), "every op of the registry is audited"
    assert set(std.op) == {n for n, op in REGISTRY.items() if op.standard}
    assert len(std) == len(inv[inv.op.isin(set(std.op))])


@pytest.mark.slow
def test_gpu_first_divergence_localises_the_standard_op():
    model = build("qwen3-1.7B", device="cuda", dtype=torch.bfloat16, seed=0)
    table = divergence_sweep(model, {"all invariant": {"default": "invariant"},
                                     "all standard": {"default": "standard"},
                                     "linear standard": {"default": "invariant", "linear": "standard"}},
                             seq_len=64, batch=16).set_index("setting")
    assert table.loc["all invariant", "ops_differing"] == 0
    assert table.loc["all standard", "ops_differing"] > 0, "negative control: standard mode must diverge"
    first = table.loc["linear standard", "first_divergence"]
    assert first.endswith("_proj") and table.loc["linear standard", "first_layer"] == 0, first

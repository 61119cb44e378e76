"""The parity audit on a real GPU (skipped without CUDA): invariant is bitwise everywhere, standard
is not, and the first divergence is localised to the op put in standard mode."""

import pytest
import torch

from workbench.audit import AUDIT_FULL, divergence_sweep, kernel_audit
from workbench.models import build

pytestmark = pytest.mark.gpu


def test_gpu_kernel_audit_invariant_bitwise_standard_not():
    table = kernel_audit(device="cuda", **AUDIT_FULL)
    inv, std = table[table["mode"] == "invariant"], table[table["mode"] == "standard"]
    assert inv.bitwise_equal.all(), inv[~inv.bitwise_equal].to_string()
    assert not std[std.op == "linear"].bitwise_equal.all(), "negative control: cuBLAS rows change with the batch"


def test_gpu_first_divergence_localises_the_standard_op():
    model = build("1.7B", device="cuda", dtype=torch.bfloat16, seed=0)
    table = divergence_sweep(model, {"all invariant": {"default": "invariant"},
                                     "all standard": {"default": "standard"},
                                     "attention standard": {"default": "invariant", "attention": "standard"}},
                             seq_len=64, batch=16).set_index("setting")
    assert table.loc["all invariant", "ops_differing"] == 0
    assert table.loc["all standard", "ops_differing"] > 0
    assert table.loc["attention standard", "first_divergence"] == "model.layers.0.self_attn.attention"

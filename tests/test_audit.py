"""The parity audit on CPU: the kernel audit finds every invariant row bitwise equal, the model-level
first-divergence report finds nothing in invariant mode and localises a planted difference."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from workbench.generation import SamplingParams, as_parity_table, format_report, parity_triangle, random_prompts
from workbench.kernels import mode
from workbench.models import build
from workbench.onoff.figures import reward_curves
from workbench.plots import audit_heatmap, logprob_diff_histogram, save_figure
from workbench.tables import load_table, save_table
from workbench.teach.audit import audit_summary, divergence_sweep, first_divergence, kernel_audit


@pytest.fixture(scope="module")
def model():
    return build("tiny", dtype=torch.bfloat16, seed=3)


def test_kernel_audit_invariant_rows_are_bitwise_everywhere():
    table = kernel_audit(batch_sizes=(1, 6, 23), ops=["linear", "rms_norm", "token_logprobs", "attention"], seed=5)
    inv = table[table["mode"] == "invariant"]
    assert inv.bitwise_equal.all() and (inv.max_ulp == 0).all()
    assert set(table.position) == {"first", "middle", "last"}
    assert (table.err_vs_fp64 < 0.05).all()
    summary = audit_summary(table)
    assert len(summary) == 8 and summary[summary["mode"] == "invariant"].bitwise_everywhere.all()
    assert audit_heatmap(table) is not None


def test_kernel_audit_covers_every_op_of_the_registry():
    """Every op, ops of another signature too (through their row-major forms), bitwise in invariant mode."""
    from workbench.kernels import REGISTRY

    table = kernel_audit(batch_sizes=(1, 4), seed=6)
    assert set(table.op) == set(REGISTRY)
    inv = table[table["mode"] == "invariant"]
    assert inv.bitwise_equal.all() and (inv.max_ulp == 0).all()
    assert set(table[table["mode"] == "standard"].op) == {n for n, op in REGISTRY.items() if op.standard}


def test_first_divergence_is_none_in_invariant_mode_and_finds_a_planted_one(model, monkeypatch):
    with mode("invariant"):
        clean = first_divergence(model, seq_len=5, batch=3, seed=1)
    assert clean.equal.all() and clean.attrs["first"] is None
    assert clean.name.iloc[-1] == "logits" and "model.layers.1.self_attn.attention" in set(clean.name)

    # Negative control: the decode path's attention scaled by 1.02 (a few bf16 ulps).
    from workbench.models import transformer

    real = transformer.attention_with_cache
    monkeypatch.setattr(transformer, "attention_with_cache", lambda *a, **k: real(*a, **k) * 1.02)
    with mode("invariant"):
        planted = first_divergence(model, seq_len=5, batch=3, seed=1)
    assert planted.attrs["first"] == "model.layers.0.self_attn.attention"
    first = planted[planted.name == planted.attrs["first"]].iloc[0]
    assert first.layer == 0 and first.op == "attention" and first.max_abs_diff > 0
    assert planted.set_index("name").loc["model.layers.0.self_attn.q_proj", "equal"], "ops before it still agree"


def test_divergence_sweep_one_row_per_setting(model):
    table = divergence_sweep(model, {"all invariant": {"default": "invariant"},
                                     "linear standard": {"default": "invariant", "linear": "standard"}},
                             seq_len=4, batch=2)
    assert list(table.setting) == ["all invariant", "linear standard"]
    assert table.iloc[0].ops_differing == 0 and table.iloc[0].first_divergence.startswith("none")


@pytest.mark.slow
def test_parity_triangle_is_bitwise_in_invariant_mode(model):
    prompts = random_prompts(3, model.config.vocab_size, min_len=2, max_len=7, seed=4)
    with mode("invariant"):
        tokens, pairs = parity_triangle(model, prompts, SamplingParams(temperature=1.0, max_new_tokens=3, seed=2))
    assert pairs.bitwise_identical.all() and (pairs.tokens == len(tokens)).all() and len(tokens) > 0
    report = format_report(as_parity_table(tokens))
    assert f"bitwise identical: True, different tokens 0 / {len(tokens)}" in report
    fig = logprob_diff_histogram({"invariant": tokens})
    assert fig.legends, "a legend names each mode"


def test_plots_are_drawn_from_tables_and_saved(tmp_path):
    rows = [{"step": s, "metric": m, "value": float(s * (seed + 1)), "variant": v, "seed": seed}
            for s in range(1, 6) for m in ("reward_mean", "entropy") for v in ("on", "off")
            for seed in (0, 1)]
    table = pd.DataFrame(rows)
    path = save_table(table, tmp_path, "on_off")
    assert path == tmp_path / "metrics" / "on_off.csv"
    again = load_table(tmp_path)
    fig = reward_curves(again, ("reward_mean", "entropy"), smooth=2)
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["reward", "entropy (nats)"]
    written = save_figure(fig, tmp_path / "figures", "on_off")
    assert all(p.exists() and p.stat().st_size > 1000 for p in written)
    ticks = fig.axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks), "steps are whole numbers on the axis"
    noted = reward_curves(again, note="smoke run: not a result")
    assert "smoke run: not a result" in noted.get_supxlabel()
    audit = pd.DataFrame({"op": ["linear", "linear", "attention"], "mode": "invariant", "rows": [1, 37, 1],
                          "max_ulp": [0, 0, 0]})
    heat = audit_heatmap(audit)
    assert "n/a" in [t.get_text() for t in heat.axes[0].texts] and "not measured" in heat.get_supxlabel()
    equal = pd.DataFrame({"decode": [-1.0, -2.0], "train": [-1.0, -2.0]})
    hist = logprob_diff_histogram({"invariant": equal, "standard": equal})
    assert any("no difference to histogram" in t.get_text() for t in hist.axes[0].texts), "an empty plot says why"
    with pytest.raises(ValueError, match="none of the metrics"):
        reward_curves(again, metrics=("nope",))
    with pytest.raises(FileNotFoundError, match="no table at"):
        load_table(tmp_path / "elsewhere")


def test_the_cpu_control_is_audited_and_drawn_at_its_own_scale():
    control = kernel_audit(batch_sizes=(1, 5), ops=["linear", "rms_norm"], dtype=torch.float32, modes=("standard",))
    assert set(control["mode"]) == {"standard"} and len(control) == 2 * 2 * 3, "one mode, no invariant kernel run"
    heat = audit_heatmap(control.assign(mode="standard fp32"), note="standard fp32: the CPU's control")
    assert heat.get_supxlabel() == "standard fp32: the CPU's control"
    assert [t.get_text() for t in heat.axes[0].get_xticklabels()] == ["standard\nfp32\nM=1", "standard\nfp32\nM=5"]
    # One fp32 ulp apart on 2 tokens: the bars sit at that difference, not in a unit-wide bin around it.
    tiny = pd.DataFrame({"decode": [-1.0, -2.0, -3.0], "train": [-1.0, -2.0 - 4.8e-7, -3.0 - 4.8e-7]})
    same = pd.DataFrame({"decode": [-1.0], "train": [-1.0]})
    hist = logprob_diff_histogram({"standard": same, "standard fp32": tiny}, title="decode vs train")
    edges = [(p.get_x(), p.get_x() + p.get_width()) for p in hist.axes[0].patches if p.get_height() > 0]
    assert edges and all(lo <= 4.8e-7 <= hi and hi - lo < 1e-7 for lo, hi in edges), edges
    assert hist.legends[0].get_title().get_text() == "decode vs train"

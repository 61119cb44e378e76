"""The token-level mismatch viewer, headless: built from a live tiny-model run on this CPU, its figure is identically 0
for `invariant` and non-zero for the CPU's mismatched controls (the engine kernels and the fp32 standard kernels: the
bf16 standard kernels agree on a CPU at these shapes); a published record is found and labelled, its absence is
None."""

from __future__ import annotations


import numpy as np
import pytest

from workbench.teach.mismatch_view import RecordConfig, live_run, main, mismatch_figure, mismatch_viewer, sequence
from workbench.records import Record, write_index, write_record
from workbench.teach.token_table import TABLE_FILE, published_tokens


@pytest.fixture(scope="module")
def live():
    return live_run(RecordConfig(device="cpu", prompts=2, tokens=5, arms=("invariant", "engine off",
                                                                          "standard fp32")), progress=False)


def _line(fig, gid):
    return next(line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid)


def test_invariant_is_identically_zero_and_the_controls_are_not(live):
    table, divergence = live
    assert set(table.arm) == {"invariant", "engine off", "standard fp32"}
    for seq in sorted(set(table.seq)):
        fig = mismatch_figure(table, "invariant", seq, divergence=divergence)
        assert not _line(fig, "cumulative").get_ydata().any() and not _line(fig, "kl").get_ydata().any()
    for arm in ("engine off", "standard fp32"):
        differ = [np.abs(_line(mismatch_figure(table, arm, s), "cumulative").get_ydata()).max()
                  for s in sorted(set(table.seq))]
        assert max(differ) > 0, arm
    rows = sequence(table, "engine off", 0)
    assert np.allclose(rows.cumulative, np.cumsum(rows.trainer_logprob - rows.sampler_logprob))
    assert divergence.set_index("arm").first_divergence["invariant"].startswith("none")


def test_the_widget_builds_and_follows_its_choices(live):
    table, divergence = live
    widget = mismatch_viewer(table, divergence)
    run, arm, seq = widget.children[:3]
    assert set(arm.options) == {"invariant", "engine off", "standard fp32"} and list(seq.options) == [0, 1]
    arm.value = "invariant"
    assert not _line(widget.result, "cumulative").get_ydata().any()
    arm.value = "engine off"
    assert "engine off" in widget.result.get_suptitle()
    assert _line(widget.result, "cumulative").get_ydata().any(), "every engine token differs at this shape"


def test_an_absent_choice_says_so(live):
    table, _ = live
    fig = mismatch_figure(table, "standard", 0)
    assert any("no sequence 0 of arm 'standard'" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_the_published_record_is_found_labelled_or_absent(live, tmp_path):
    assert published_tokens(tmp_path) is None
    table, _ = live
    for name, gpu in (("2026-12-01_token-mismatch-h100_abc", "NVIDIA H100"),
                      ("2026-12-02_token-mismatch-h200_def", "NVIDIA H200")):
        (tmp_path / name).mkdir()
        table.drop(columns="source").to_csv(tmp_path / name / TABLE_FILE, index=False)
        write_record(tmp_path / name, Record(name, "parity", "tokens", {}, gpu, name[-3:], name[:10], "cmd", "v"))
    write_index(tmp_path)
    (tmp_path / "2026-12-03_token-mismatch-x").mkdir()   # newer, but the index does not list it: not found
    table.drop(columns="source").to_csv(tmp_path / "2026-12-03_token-mismatch-x" / TABLE_FILE, index=False)
    found = published_tokens(tmp_path)
    assert found.label == "published, GPU, NVIDIA H200, 2026-12-02" and found.folder.name.startswith("2026-12-02")
    assert set(found.table.source) == {found.label} and len(found.table) == len(table)


def test_bad_arms_are_one_line(capsys):
    assert main(["--arms", "fp9", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown arm" in err and "invariant" in err

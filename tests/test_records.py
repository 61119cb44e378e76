"""The records under docs/results: every folder has README.md and a result.json of the schema, the index is
generated from them, and code finds published folders through the index."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from workbench.onoff.probe import published_metrics
from workbench.records import Record, build_index, load_index, read_record, stale, write_index, write_record

ROOT = Path(__file__).resolve().parents[1] / "docs" / "results"
LARGE = {"2026-11-23_onoff-blog-h100_1272149/metrics.csv.gz", "2026-11-23_onoff-blog-dose-h100_1272149/metrics.csv.gz",
         "2026-11-27_onoff-blog-h100_8217c92/metrics.csv.gz", "2026-11-24_onoff-long-h100_36e864a/metrics.csv.gz",
         "2026-11-24_onoff-blog-vllm-h100_5010901/metrics.csv.gz",
         "2026-11-23_onoff-realistic-h100_bc1f238/metrics.csv.gz"}
"""The raw tables over 1 MB that notebook 05 and `published_metrics` read; no other file may be that large."""


def test_every_record_folder_has_a_readme_and_a_result_of_the_schema_and_the_index_is_current():
    folders = sorted(p.name for p in ROOT.iterdir() if p.is_dir())
    assert folders, "docs/results has record folders"
    for name in folders:
        assert (ROOT / name / "README.md").exists(), f"{name} has no README.md"
        record = read_record(ROOT / name)  # raises on a result.json off the schema
        assert record.folder == name and record.question and record.command and record.verdict
    assert [r.folder for r in load_index(ROOT)] == [r.folder for r in build_index(ROOT)]
    assert stale(ROOT) == [], "run `python -m workbench.records` and commit what it writes"


def test_no_large_raw_file_is_added_to_the_records():
    large = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and p.stat().st_size > 1 << 20}
    assert large <= LARGE, f"files over 1 MB in docs/results: {sorted(large - LARGE)}; keep raw files small"


MODEL_PART = 24_000_000
"""The size of the parts the model's wheel travels to the GPU in (scripts/device_onoff.sh STEP=stash / model)."""


def test_the_tree_leaves_a_device_call_room_for_a_part_of_the_model():
    """A device call carries the tracked tree and one carried folder within 64 MiB; every GPU hold starts bare and
    carries the real model in parts beside the tree. The records grow with every hold: past this the model no
    longer travels, and no arm can run."""
    root = ROOT.parents[1]
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode:
        pytest.skip("not a git checkout")
    tree = sum((root / f).stat().st_size for f in listed.stdout.decode().split("\0") if f and (root / f).is_file())
    room = (64 << 20) - MODEL_PART - (1 << 20)   # 1 MiB for the gguf wheel of the last part and slack
    assert tree <= room, (f"the tracked tree is {tree / 1e6:.1f} MB; with a model part of {MODEL_PART / 1e6:.0f} MB "
                          f"a device call holds {room / 1e6:.1f} MB of it: make records smaller (or the parts)")


def test_a_result_off_the_schema_is_named_in_one_line(tmp_path):
    good = Record("2026-12-01_x-cpu_abc", "speed", "q", {}, "CPU", "abc", "2026-12-01", "python x.py", "v")
    (tmp_path / good.folder).mkdir()
    write_record(tmp_path / good.folder, good)
    assert read_record(tmp_path / good.folder) == good
    data = json.loads((tmp_path / good.folder / "result.json").read_text())
    for broken, message in (({k: v for k, v in data.items() if k != "verdict"}, "missing keys ['verdict']"),
                            ({**data, "kind": "diary"}, "kind 'diary' is not one of"),
                            ({**data, "figures": {"t": {"value": "fast"}}}, "not a finite number"),
                            ({**data, "date": "yesterday"}, "is not YYYY-MM-DD")):
        (tmp_path / good.folder / "result.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=re.escape(message)) as err:
            read_record(tmp_path / good.folder)
        assert "\n" not in str(err.value) and "result.json" in str(err.value)


def test_the_index_not_the_folder_name_says_what_a_folder_is(tmp_path):
    for name, kind, preset in (("2026-12-01_onoff-blog-h100_aaa", "speed", ""), ("2026-12-02_zzz", "onoff", "blog")):
        (tmp_path / name).mkdir()
        write_record(tmp_path / name, Record(name, kind, "q", {}, "x", "a", name[:10], "c", "v", preset=preset))
        pd.DataFrame({"step": [1], "metric": ["m"], "value": [1.0], "variant": ["on"], "seed": [0]}).to_csv(
            tmp_path / name / "metrics.csv.gz", index=False)
    assert published_metrics(tmp_path, "blog", "on").empty, "no index yet: nothing is published"
    write_index(tmp_path)
    assert list(published_metrics(tmp_path, "blog", "on").source) == ["2026-12-02_zzz"]


def test_the_published_views_read_the_real_index():
    table = published_metrics("docs/results", "blog", "off-vllm")
    assert set(table.source) == {"2026-11-24_onoff-blog-vllm-h100_5010901"}, "a variant of the preset counts"
    newest = published_metrics("docs/results", "regime", "on").source.iloc[0]
    ran_on = [r for r in load_index("docs/results") if r.preset == "regime-arm" and "-arm-on-" in r.folder]
    assert len(ran_on) >= 2 and newest == max(ran_on, key=lambda r: (r.date, r.folder)).folder, \
        "the newest record that ran the arm, of the preset's `-arm` variant"


def _numbers(cell: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", cell.replace("`", " "))]


def test_every_benchmarks_row_links_its_record_and_the_record_holds_its_figures():
    """A row of a BENCHMARKS.md table with a `record` column: its record exists, the record's result.json holds the
    row's figure and its same-run baseline (the first number of each cell), and the row's commit is the record's or
    one its README names. Floors (peaks, copy bandwidth) are constants of the device, not checked here."""
    rows = 0
    header: list[str] = []
    for line in (ROOT.parents[1] / "BENCHMARKS.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if "record" in cells:
            header = cells
            continue
        if not cells or not header or set(line) <= set("|-: ") or len(cells) != len(header):
            header = header if cells else []
            continue
        row = dict(zip(header, cells))
        link = re.search(r"\]\((docs/results/[^)]+?)/?\)", row["record"])
        assert link, f"BENCHMARKS.md row {row['what']!r} has no record link"
        folder = ROOT.parents[1] / link.group(1)
        record = read_record(folder)
        held = {x for f in record.figures.values() for x in (f.value, f.baseline, f.floor) if x is not None}
        for column in ("figure", "baseline, same run"):
            if numbers := _numbers(row[column]):
                assert numbers[0] in held, \
                    f"BENCHMARKS.md row {row['what']!r}: {column} {numbers[0]} is not in {folder.name}/result.json"
        assert row["commit"] == record.commit or row["commit"] in (folder / "README.md").read_text(), \
            f"BENCHMARKS.md row {row['what']!r}: commit {row['commit']} is not {folder.name}'s"
        rows += 1
    assert rows >= 30, f"only {rows} rows with a record found in BENCHMARKS.md"

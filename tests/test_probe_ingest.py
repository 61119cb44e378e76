"""bench/probe_ingest.py's bound: the least bytes an SM takes in for a decode product whose outputs keep their
whole K chain on one SM, against a search over every whole-number block of its outputs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
probe_ingest = pytest.importorskip("probe_ingest")


@pytest.mark.parametrize("m", [64, 256])
@pytest.mark.parametrize("name", list(probe_ingest.QWEN3_1P7B))
def test_least_bytes_is_a_lower_bound_that_whole_blocks_nearly_reach(m, name):
    n, k, _ = probe_ingest.QWEN3_1P7B[name]
    sms = 132
    outputs = m * n / sms
    # An SM holding R rows needs ceil(outputs / R) columns (at most n) to cover its share.
    searched = min((r + math.ceil(outputs / r)) * k * 2 for r in range(1, m + 1) if math.ceil(outputs / r) <= n)
    bound = probe_ingest.least_bytes(m, n, k, sms)
    assert bound <= searched, (m, name, bound, searched)
    assert searched <= bound * 1.03, (m, name, bound, searched)

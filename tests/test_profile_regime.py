"""bench/profile_regime.py: the floors' arithmetic at SmolLM2-135M's shape (the issue's 0.27 GB of weights, ~0.4 ms a
decode step at batch 64 and 2,048 tokens), and the script end to end on the CPU at the smoke size."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.models.config import config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from profile_regime import BF16_FLOPS, HBM_BYTES_S, Shape, floors  # noqa: E402


def test_floors_at_the_smollm2_shape():
    shape = Shape.of(config("smollm2-135M"))
    assert 134e6 < shape.params < 136e6 and shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    f = floors(shape, 64, 2048.0, 1, True, 0.0, HBM_BYTES_S, BF16_FLOPS)
    per_step = f["generate"] / 2048
    # The weights once (0.27 GB) and on average half the 2,048 tokens' keys and values of 64 rows, per step.
    assert math.isclose(per_step, (2 * shape.params + 64 * 1024 * shape.kv_bytes_per_token) / HBM_BYTES_S)
    assert 0.2e-3 < per_step < 0.5e-3, per_step
    assert math.isclose(f["update"], 3 * f["score"]) and f["sync"] == 0
    assert floors(shape, 64, 2048.0, 2, False, 1e9, HBM_BYTES_S, BF16_FLOPS)["score"] == 0


@pytest.mark.slow
def test_profile_regime_smoke(tmp_path):
    out = tmp_path / "profile.md"
    done = subprocess.run([sys.executable, str(ROOT / "bench/profile_regime.py"), "--smoke", "--steps", "2",
                           "--out-dir", str(tmp_path / "runs"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in out.read_text().splitlines() if line.startswith("| on") or line.startswith("| off")]
    phases = {(line.split(" | ")[0][2:], line.split(" | ")[3]) for line in lines}
    assert phases == {(arm, phase) for arm in ("on", "off")
                      for phase in ("generate", "score", "update", "sync", "other", "step")}

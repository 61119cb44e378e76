"""The one-GPU step's breakdown (bench/step_breakdown.py) from a run's long metrics table: its parts are the
medians of the logged times after the warm-up steps, update is `train`'s half less its scoring, and `other` is each
step's rest (fresh random times; the seed is in the message)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pandas as pd
import pytest

from helpers import seed_for

BENCH = Path(__file__).resolve().parents[1] / "bench" / "step_breakdown.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("step_breakdown", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _metrics(rng: random.Random, steps: int) -> pd.DataFrame:
    rows = []
    for step in range(1, steps + 1):
        gen, score, update, sync, other = (rng.uniform(0.1, 10) for _ in range(5))
        values = {"time_generate": gen, "time_score": score, "time_train": score + update, "time_sync": sync,
                  "time_step": gen + score + update + sync + other, "tokens_per_s": rng.uniform(1e3, 2e4),
                  "response_length": rng.uniform(10, 1024), "parity_tokens_differing": 0.0}
        rows += [{"step": step, "metric": k, "value": v} for k, v in values.items()]
    return pd.DataFrame(rows)


def test_parts_are_medians_after_warmup_and_add_up(bench):
    seed = seed_for()
    metrics = _metrics(random.Random(seed), 5)
    r = bench.breakdown(metrics, warmup=1)
    wide = metrics.pivot_table(index="step", columns="metric", values="value").loc[2:]
    assert r["steps"] == "2-5", seed
    assert r["generate"] == pytest.approx(wide["time_generate"].median()), seed
    assert r["update"] == pytest.approx((wide["time_train"] - wide["time_score"]).median()), seed
    assert r["step"] == pytest.approx(wide["time_step"].median()), seed
    # `other` is each step's rest, then its median (medians of parts need not add up to the median step).
    rest = wide["time_step"] - wide["time_generate"] - wide["time_train"] - wide["time_sync"]
    assert r["other"] == pytest.approx(rest.median()), seed
    assert r["differing"] == 0, seed


def test_runs_it_cannot_take_apart_are_named(bench, tmp_path):
    metrics = _metrics(random.Random(0), 2)
    metrics = metrics[metrics.metric != "time_score"]
    (tmp_path / "old").mkdir()
    metrics.to_csv(tmp_path / "old" / "metrics.csv", index=False)
    with pytest.raises(SystemExit, match="time_score"):
        bench.table([tmp_path / "old"], 1)
    with pytest.raises(SystemExit, match="no metrics"):
        bench.table([tmp_path / "missing"], 1)
    split = _metrics(random.Random(0), 2)
    split = pd.concat([split, pd.DataFrame([{"step": 1, "metric": "time_trainer_wait", "value": 1.0}])])
    (tmp_path / "split").mkdir()
    split.to_csv(tmp_path / "split" / "metrics.csv", index=False)
    with pytest.raises(SystemExit, match="split-roles"):
        bench.table([tmp_path / "split"], 1)

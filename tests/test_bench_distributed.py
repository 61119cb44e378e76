"""The N-GPU benchmark's plan (bench/bench_distributed.py), without running it: every split run's prompts a step
share evenly on both sides and are the most that do, every N-GPU run has its one-GPU parity reference at its own
prompts a step, and at 2 GPUs the runs are the 2-GPU benchmark's of before (one, colocated, FSDP2, split sync and
async at 1:1, parity at twice the prompts)."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path

import pytest

from helpers import seed_for

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_distributed.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))   # as `python bench/bench_distributed.py` has it: timing.py beside it
    spec = importlib.util.spec_from_file_location("bench_distributed", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path.remove(str(BENCH.parent))


def test_two_gpus_are_the_runs_of_before(bench):
    runs = bench.plan(2, 32, bench.rollout_counts(2))
    assert [(r.name, r.gpus, r.prompts, r.rollout_ranks, r.policy_lag, r.parallel) for r in runs] == [
        ("one", 1, 32, 0, 0, "replicate"), ("dp", 2, 64, 0, 0, "replicate"), ("dp-fsdp2", 2, 64, 0, 0, "fsdp2"),
        ("split-1r1t-sync", 2, 64, 1, 0, "replicate"), ("split-1r1t-async", 2, 64, 1, 1, "replicate"),
        ("parity-64", 1, 64, 0, 0, "replicate")]
    assert [r.parity for r in runs] == [False] * 5 + [True]


def test_every_split_shares_evenly_and_has_its_parity_run(bench):
    seed = seed_for()
    rng = random.Random(seed)
    for _ in range(200):
        gpus, prompts = rng.randint(2, 16), rng.randint(4, 64)
        runs = bench.plan(gpus, prompts, bench.rollout_counts(gpus))
        msg = f"seed {seed}: {gpus} GPUs x {prompts} prompts"
        splits = [r for r in runs if r.rollout_ranks]
        assert {r.rollout_ranks for r in splits} == set(bench.rollout_counts(gpus)), msg
        assert all(0 < r < gpus for r in bench.rollout_counts(gpus)), msg
        for r in splits:
            rollout, trainer = r.rollout_ranks, r.gpus - r.rollout_ranks
            assert r.prompts % rollout == 0 and r.prompts % trainer == 0, (msg, r)
            assert gpus * prompts - math.lcm(rollout, trainer) < r.prompts <= gpus * prompts, (msg, r)
        colocated = [r for r in runs if r.name in ("dp", "dp-fsdp2")]
        assert [r.prompts for r in colocated] == [gpus * prompts] * 2, msg
        parity = {r.prompts for r in runs if r.parity}
        assert parity == {r.prompts for r in runs if r.gpus > 1}, msg
        assert all(r.gpus == 1 for r in runs if r.parity) and len({r.name for r in runs}) == len(runs), msg


def test_four_gpus_measure_every_ratio(bench):
    names = [r.name for r in bench.plan(4, 32, bench.rollout_counts(4))]
    assert names == ["one", "dp", "dp-fsdp2", "split-1r3t-sync", "split-1r3t-async", "split-2r2t-sync",
                     "split-2r2t-async", "split-3r1t-sync", "split-3r1t-async", "parity-128", "parity-126"]
    # With a sampled parity check, the runs that score in a pass of their own again, beside their fully checked twin.
    sampled = [r for r in bench.plan(4, 32, [2], parity_sample=8) if r.parity_sample == 8]
    assert [r.name for r in sampled] == ["dp-fsdp2-check8", "split-2r2t-sync-check8", "split-2r2t-async-check8"]


def test_too_few_prompts_for_a_split_says_what_to_pass(bench):
    with pytest.raises(SystemExit, match=r"^1 prompts per GPU x 5 GPUs cannot be shared by 2 rollout and 3 trainer "
                                         r"ranks: pass --prompts 2 or more, or leave 2 out of --rollout-ranks$"):
        bench.plan(5, 1, [2])
    with pytest.raises(SystemExit, match=r"--rollout-ranks 4: a split of 4 GPUs needs 1 to 3 rollout ranks"):
        bench.plan(4, 32, [4])


def test_a_run_resumes_only_with_its_own_settings(bench, tmp_path):
    """A --work folder keeps a finished run; the same run with another setting (here --new-tokens) under the same
    --work is run again, not read as the old one, and so is a folder whose config.yaml this tree cannot read."""
    import argparse

    import pandas as pd

    from workbench.config import write_config

    args = argparse.Namespace(work=str(tmp_path), shape="tiny", steps=2, group=2, new_tokens=3, microbatch_tokens=64,
                              device="cpu", keep_graphs=True, activation_checkpointing="none")
    run = bench.plan(2, 1, [1])[1]
    cfg = bench._run_config(run, args, tmp_path / "policy")
    folder = Path(cfg.out_dir)
    folder.mkdir(parents=True)
    write_config(cfg, folder / "config.yaml")
    pd.DataFrame({"step": [1, 2], "metric": ["loss"] * 2, "value": [0.0] * 2}).to_csv(folder / "metrics.csv")
    assert bench._complete(cfg)
    assert not bench._complete(bench._run_config(run, argparse.Namespace(**{**vars(args), "new_tokens": 4}),
                                                 tmp_path / "policy"))
    (folder / "config.yaml").write_text("no_such_setting: 1\n")
    assert not bench._complete(cfg)

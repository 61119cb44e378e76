"""Issues 17 and 44 on a host with 2 GPUs or more, over NCCL (skipped with fewer): the weight broadcast moves the
exact bits and its check names a corrupted rank; the trainer at world size 2 (replicated, FSDP2, split roles at
policy lag 1), and at every GPU of a host of 3 or more (colocated, split roles in several ratios), gives the
one-process step-1 log-probs bit for bit, 0 differing tokens on every rank, and with split roles and one trainer
rank the one-process run's metrics. The same properties on CPU (gloo): tests/test_distributed.py, test_data_parallel.py,
test_split_roles.py, test_fsdp.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from workbench.distributed import launch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")]

TIMES = ("time_", "tokens_per_s", "sync_bytes")
"""Metrics that measure the run rather than the training (prefixes)."""


def _broadcast_worker(result: str) -> None:
    from workbench.distributed import broadcast
    from workbench.models import build, weights_equal

    d = launch.init("cuda")
    # Rank 1 starts from other weights; after the broadcast it holds rank 0's bits (checked against a rebuild).
    model = build("qwen3-0.6B", device=d.device, dtype=torch.bfloat16, seed=0 if d.rank == 0 else 1)
    r = broadcast.broadcast_weights(model, 7 if d.rank == 0 else None, bucket_bytes=64 << 20)
    expected = build("qwen3-0.6B", device=d.device, dtype=torch.bfloat16, seed=0)
    same = weights_equal(dict(model.state_dict()), dict(expected.state_dict()))
    if d.rank == 1:   # one bit of one tensor, after the transfer
        with torch.no_grad():
            model.model.layers[3].mlp.down_proj.weight.view(torch.int16)[5, 9] ^= 1
    try:
        broadcast.verify_weights(model, 7 if d.rank == 0 else None)
        error = ""
    except RuntimeError as e:
        error = str(e)
    torch.save({"version": r.version, "buckets": r.buckets, "same": same, "error": error}, f"{result}.{d.rank}")


def test_gpu_broadcast_moves_the_bits_and_names_a_corrupted_rank(tmp_path):
    launch.spawn(_broadcast_worker, 2, str(tmp_path / "r"))
    for rank in (0, 1):
        r = torch.load(tmp_path / f"r.{rank}")
        assert r["version"] == 7 and r["buckets"] > 1 and r["same"], r
        assert "ranks [1] hold other bits" in r["error"], r["error"]
        assert "model.layers.3.mlp.down_proj.weight" in r["error"], r["error"]


def _cfg(policy: str, out: Path, **kw):
    from workbench.rl.config import TrainConfig

    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=4, group_size=4, max_new_tokens=8,
                       kernel_mode="invariant", checkpoint_every=1, lr=3e-3, progress=False, device="cuda",
                       sync="copy", mini_batches=2)
    return dataclasses.replace(base, **kw)


RUNS = {"two": {}, "fsdp2": {"parallel": "fsdp2"}, "split": {"rollout_ranks": 1, "policy_lag": 1}}
"""The world-size-2 runs: replicated, FSDP2 trainer ranks, split roles (rank 1 generates) at policy lag 1."""


def _train_worker(policy: str, root: str, runs: dict) -> None:
    from workbench.rl.trainer import train

    for name, kw in runs.items():
        train(_cfg(policy, Path(root) / name, **kw))


def _match_one_process(root: Path, names, split: str) -> None:
    """Every run of `names` has step-1 log-probs (generator and trainer) equal to the one-process run `one-lag`'s
    generator's bits and 0 differing tokens at both steps; `split` (split roles, one trainer rank) has `one-lag`'s
    metrics bit for bit."""
    reference = np.load(root / "one-lag" / "step1_logprobs.npz")
    for name in names:
        got = np.load(root / name / "step1_logprobs.npz")
        for side in ("generator", "trainer"):
            assert got[side].tobytes() == reference[side].tobytes() == reference["generator"].tobytes(), (name, side)
        metrics = pd.read_csv(root / name / "metrics.csv")
        differing = metrics[metrics.metric == "parity_tokens_differing"].value
        assert len(differing) == 2 and (differing == 0).all(), name
    # Both tables read back from their CSVs with Python's float(), which is exact: pandas' default parser may be off
    # by an ulp (0.10000000149011612 came back as 0.1000000014901161), and its float_precision is deprecated.
    got, ref = (pd.read_csv(root / name / "metrics.csv", converters={"value": float})
                .pivot(index="step", columns="metric", values="value") for name in (split, "one-lag"))
    kept = [c for c in ref.columns if not c.startswith(TIMES)]
    pd.testing.assert_frame_equal(got[kept], ref[kept], check_exact=True)


def test_gpu_world_size_two_is_one_process_bitwise(policy, tmp_path):
    from workbench.rl.trainer import train

    launch.spawn(_train_worker, 2, policy, str(tmp_path), RUNS)
    one = train(_cfg(policy, tmp_path / "one"))
    train(_cfg(policy, tmp_path / "one-lag", policy_lag=1))
    _match_one_process(tmp_path, RUNS, "split")
    # Replicated and FSDP2: the one-process update up to the gradient's summation order.
    first = one[one.step == 1].set_index("metric")["value"]
    for name in ("two", "fsdp2"):
        got = pd.read_csv(tmp_path / name / "metrics.csv")
        got = got[got.step == 1].set_index("metric")["value"]
        for m in ("loss", "grad_norm", "weight_delta_l2"):
            assert got[m] == pytest.approx(first[m], rel=1e-4, abs=1e-6), (name, m)


def _splits(gpus: int) -> list[int]:
    """Rollout ranks of the every-GPU test's split runs: one, half, and all but one trainer rank."""
    return sorted({1, gpus // 2, gpus - 1})


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs or more")
def test_gpu_every_gpu_of_the_host_is_one_process_bitwise(policy, tmp_path):
    """Issue 44 at N = every GPU of the host (3 or more): colocated over N, and split roles with 1, N/2 and N - 1
    rollout ranks at policy lag 1 (several receivers of each weight broadcast, several trainer ranks), on a step
    every side shares evenly. Step 1's log-probs are the one-process run's bits, 0 tokens differ on every step, and
    with a single trainer rank the metrics are the one-process run's bit for bit."""
    import math

    from workbench.rl.trainer import train

    gpus = torch.cuda.device_count()
    prompts = math.lcm(gpus, *(n for r in _splits(gpus) for n in (r, gpus - r)))
    runs = {"dp": {"prompts_per_step": prompts}}
    runs |= {f"split-{r}": {"prompts_per_step": prompts, "rollout_ranks": r, "policy_lag": 1} for r in _splits(gpus)}
    # Half the ranks generating, each recomputing 1 of 4 completions of step 2 for the check (parity_sample).
    runs["split-check4"] = {"prompts_per_step": prompts, "rollout_ranks": gpus // 2, "policy_lag": 1,
                            "parity_sample": 4}
    launch.spawn(_train_worker, gpus, policy, str(tmp_path), runs)
    train(_cfg(policy, tmp_path / "one-lag", prompts_per_step=prompts, policy_lag=1))
    _match_one_process(tmp_path, runs, f"split-{gpus - 1}")
    checked = {name: pd.read_csv(tmp_path / name / "metrics.csv").query("metric == 'parity_tokens_checked'").value
               for name in ("split-check4", "one-lag")}
    assert checked["split-check4"].iloc[0] == checked["one-lag"].iloc[0], "step 1 checks every completion"
    assert 0 < checked["split-check4"].iloc[1] < checked["one-lag"].iloc[1] / 2, checked

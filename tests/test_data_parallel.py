"""The trainer under torchrun: replicated data parallelism (workbench/distributed/data_parallel.py), in 2 gloo
processes on CPU started by `launch.spawn`, on the session's small arithmetic policy, 2 prompts x 2 completions a
step: identical replicas, rank 0's files, bitwise resume, one-process log-probs and gradient."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from helpers import same_bits

from workbench.distributed import launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_prompts_are_shared_by_whole_groups_and_bad_splits_say_what_to_set():
    from workbench.distributed.data_parallel import DataParallel

    def rank(r: int, world: int = 2) -> DataParallel:
        return DataParallel(launch.Dist(r, world, r, torch.device("cpu"), "gloo"))

    assert (rank(0).shard(4), rank(1).shard(4)) == (slice(0, 2), slice(2, 4))
    with pytest.raises(ValueError, match=r"prompts_per_step=3 does not split evenly over 2 ranks: set "
                                         r"prompts_per_step to a multiple of 2 \(e.g. 2 or 4\)"):
        rank(1).shard(3)
    with pytest.raises(ValueError, match="prompts_per_step=2 leaves some of the 4 ranks without work"):
        rank(0, 4).shard(2)
    assert DataParallel(launch.Dist(0, 1, 0, torch.device("cpu"), None)).shard(3) == slice(0, 3)


def _dp_cfg(policy: str, out, **kw):
    from workbench.rl.config import TrainConfig

    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="standard", checkpoint_every=1, lr=3e-3, progress=False)
    return dataclasses.replace(base, **kw)


def _record_writes(root: str, seen: list) -> None:
    """An audit hook recording every file or folder this process creates, changes or renames under root."""
    import sys

    def hook(event, args):
        path = args[0] if args and isinstance(args[0], (str, os.PathLike)) else ""
        if not os.fspath(path).startswith(root):
            return
        if event == "open":
            mode, flags = args[1], args[2]
            if (mode and any(c in mode for c in "wxa+")) or (mode is None and flags & (os.O_WRONLY | os.O_RDWR)):
                seen.append((event, os.fspath(path)))
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree"):
            seen.append((event, os.fspath(path)))

    sys.addaudithook(hook)


def _all_reduce_grads_in_buckets(rank: int) -> None:
    """Gradients without a flat buffer: summed over the ranks in fp32 buckets, a missing one counted as zeros."""
    from types import SimpleNamespace

    from workbench.distributed import data_parallel

    dp = data_parallel.DataParallel(launch.init("cpu"))
    params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(1)]
    grads = [torch.full((3,), 0.5 + rank, dtype=torch.bfloat16), None, torch.tensor([3.0 * rank])]
    for p, g in zip(params, grads):
        p.grad = g
    buckets, data_parallel.GRAD_BUCKET_ELEMENTS = data_parallel.GRAD_BUCKET_ELEMENTS, 5   # [3], [8], [1]
    try:
        dp.all_reduce_grads(SimpleNamespace(grad_buffer=None, params=params))
    finally:
        data_parallel.GRAD_BUCKET_ELEMENTS = buckets
    assert [p.grad.tolist() for p in params] == [[2.0] * 3, [[0.0] * 4] * 2, [3.0]]
    assert params[0].grad.dtype == torch.bfloat16


def _trainer_worker(policy: str, root: str) -> None:
    from pathlib import Path

    from workbench.rl import step as step_module
    from workbench.rl import trainer
    from workbench.rl.weights import TrainWeights

    d = launch.init("cpu")
    _all_reduce_grads_in_buckets(d.rank)
    runs, writes = [], []
    if not d.is_main:
        _record_writes(str(Path(root) / "runs"), writes)
    init = trainer.TrainerRank.__init__

    def keep(self, *args):
        init(self, *args)
        runs.append(self)

    trainer.TrainerRank.__init__ = keep
    out = Path(root) / "runs"
    tables = {"a": trainer.train(_dp_cfg(policy, out / "a")),
              "b": trainer.train(_dp_cfg(policy, out / "b"))}   # the same config again
    masters = {k: v.detach().clone() for k, v in runs[0].weights.masters.items()}
    trainer.train(_dp_cfg(policy, out / "c", steps=1))
    tables["c"] = trainer.train(_dp_cfg(policy, out / "c", resume=True))
    torch.save({"tables": tables, "masters": masters}, Path(root) / f"rank{d.rank}.pt")
    # bf16 LoRA adapters (autograd's gradients, summed in fp32 buckets), 4 mini-batches of 1 sequence: in each,
    # one rank holds no row and adds zeros. The replica check after each optimizer step passes.
    lora = trainer.train(_dp_cfg(policy, out / "f", steps=1, adapter="lora", master_dtype="bfloat16", mini_batches=4))
    assert lora.set_index("metric")["value"]["optimizer_steps"] == 4

    # Rank 1's replica drifts by one bit after its first optimizer step: both ranks stop, naming rank 1.
    step = TrainWeights.step

    def drift(self):
        result = step(self)
        if d.rank == 1:
            self.masters["model.norm.weight"].detach().view(torch.int32)[0] ^= 1
        return result

    TrainWeights.step = drift
    try:
        with pytest.raises(RuntimeError, match=r"step 1: the data-parallel replicas diverged: ranks \[1\] .*"
                                               r"master model\.norm\.weight"):
            trainer.train(_dp_cfg(policy, out / "d"))
    finally:
        TrainWeights.step = step

    # A loss that is not finite on rank 1 alone stops both ranks with the same error (none waits for the other).
    losses = step_module.get_loss("grpo")

    def nan_on_rank_1(*args):
        loss, stats = losses.fn(*args)
        return loss * (float("nan") if d.rank == 1 else 1.0), stats

    step_module.get_loss = lambda name: dataclasses.replace(losses, fn=nan_on_rank_1)
    with pytest.raises(FloatingPointError, match="step 1: the loss is nan"):
        trainer.train(_dp_cfg(policy, out / "e"))
    assert writes == [], f"rank {d.rank} wrote {writes[:3]}"


def test_trainer_at_world_size_two_keeps_replicas_identical_and_resumes_bitwise(policy, tmp_path):
    import pandas as pd
    from safetensors.torch import load_file

    from workbench.rl.checkpoint import latest_checkpoint

    launch.spawn(_trainer_worker, 2, policy, str(tmp_path))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    runs = tmp_path / "runs"
    # The replicas are the same bits, and rank 0's checkpoint holds them in the one-process format.
    assert same_bits(rank0["masters"], rank1["masters"])
    assert same_bits(load_file(latest_checkpoint(runs / "a") / "masters.safetensors"), rank0["masters"])
    a = rank0["tables"]["a"].pivot(index="step", columns="metric", values="value")
    assert list(a.index) == [1, 2] and (a["weight_delta_l2"] > 0).all() and (a["grad_norm"] > 0).any()
    # Rank 0 wrote the run's files (rank 1 nothing: its audit hook saw no write); every rank returns the table
    # of the whole step, the slowest rank's times included.
    assert sorted(p.name for p in (runs / "a").iterdir()) == ["checkpoints", "config.yaml", "metrics.csv",
                                                             "step1_logprobs.npz"]
    for name in ("a", "b", "c"):
        assert rank0["tables"][name].equals(rank1["tables"][name])
    # Reproducible at a given world size, and a resumed run is the uninterrupted one, bit for bit.
    timing = a.columns.str.startswith("time_") | (a.columns == "tokens_per_s")
    for name in ("b", "c"):
        other = rank0["tables"][name].pivot(index="step", columns="metric", values="value")
        pd.testing.assert_frame_equal(other.loc[:, ~timing], a.loc[:, ~timing])
        assert same_bits(load_file(latest_checkpoint(runs / name) / "masters.safetensors"),
                     load_file(latest_checkpoint(runs / "a") / "masters.safetensors")), name
    assert (runs / "d" / "metrics.csv").exists() and not (runs / "d" / "checkpoints").exists()
    # The checkpoint is in the one-process format: the world-size-2 run goes on in one process.
    from workbench.rl.trainer import train

    assert set(train(_dp_cfg(policy, runs / "a", steps=3, resume=True)).step) == {1, 2, 3}


def _grad_recorder(path):
    """TrainWeights.step that first saves the gradient it is about to apply (summed over the ranks)."""
    from workbench.rl.weights import TrainWeights

    step = TrainWeights.step

    def record(self):
        torch.save({k: m.grad.clone() for k, m in self.masters.items()}, path)
        return step(self)

    return record


def _invariant_worker(policy: str, root: str) -> None:
    from pathlib import Path

    from workbench.rl import scoring, trainer
    from workbench.rl.rollout import RolloutBatch
    from workbench.rl.trainer import train
    from workbench.rl.weights import TrainWeights

    d = launch.init("cpu")
    step_weights = TrainWeights.step
    TrainWeights.step = _grad_recorder(Path(root) / f"grads{d.rank}.pt")
    train(_dp_cfg(policy, Path(root) / "two", kernel_mode="invariant", steps=1))
    # The same run through the separate scoring pass (the step above scored in its update: scoring.scores_in_update).
    eligible, scoring.scores_in_update = scoring.scores_in_update, lambda *args: False
    TrainWeights.step = _grad_recorder(Path(root) / f"grads_scored{d.rank}.pt")
    train(_dp_cfg(policy, Path(root) / "two-scored", kernel_mode="invariant", steps=1))
    scoring.scores_in_update, TrainWeights.step = eligible, step_weights

    # Rank 1's sampled log-probs off by 1e-3: the parity check (in the update, after its backward) is over every
    # rank's tokens, so both ranks stop, before the optimizer step: the weights as they were on each.
    build, runs, init = RolloutBatch.from_generation, [], trainer.TrainerRank.__init__

    def off_on_rank_1(*args, **kw):
        batch = build(*args, **kw)
        batch.behavior += 1e-3 * batch.mask * d.rank
        return batch

    def keep(self, *args):
        init(self, *args)
        runs.append((self, {k: v.detach().clone() for k, v in self.weights.masters.items()}))

    RolloutBatch.from_generation, trainer.TrainerRank.__init__ = staticmethod(off_on_rank_1), keep
    with pytest.raises(trainer.ParityError, match=r"step 1: generator and trainer log-probs differ on \d+ of "):
        train(_dp_cfg(policy, Path(root) / "broken", kernel_mode="invariant", steps=1))
    run, start = runs[0]
    assert same_bits({k: v.detach() for k, v in run.weights.masters.items()}, start) and not run.weights.opt.state


@pytest.mark.slow
def test_world_size_two_matches_one_process_logprobs_bitwise_and_update_closely(policy, tmp_path, monkeypatch):
    import numpy as np
    import pandas as pd

    from workbench.rl.trainer import train
    from workbench.rl.weights import TrainWeights

    launch.spawn(_invariant_worker, 2, policy, str(tmp_path))
    monkeypatch.setattr(TrainWeights, "step", _grad_recorder(tmp_path / "grads_one.pt"))
    train(_dp_cfg(policy, tmp_path / "one", kernel_mode="invariant", steps=1))

    # The same request ids on either side: the same completions, and their log-probs are the same bits on both
    # sides of each run (0 differing tokens over every rank's) and across the world sizes.
    two = pd.read_csv(tmp_path / "two" / "metrics.csv").set_index("metric")["value"]
    one = pd.read_csv(tmp_path / "one" / "metrics.csv").set_index("metric")["value"]
    assert two["parity_tokens_differing"] == 0 and two["parity_max_abs_diff"] == 0
    lp1, lp2 = np.load(tmp_path / "one" / "step1_logprobs.npz"), np.load(tmp_path / "two" / "step1_logprobs.npz")
    assert len(lp2["generator"]) == one["response_length"] * 4 and two["response_length"] == one["response_length"]
    for side in ("generator", "trainer"):
        assert lp2[side].tobytes() == lp1[side].tobytes() == lp2["generator"].tobytes()
    # The update: the gradient summed over the ranks is the one-process gradient, up to the summation order.
    g1, g2 = torch.load(tmp_path / "grads_one.pt"), torch.load(tmp_path / "grads0.pt")
    assert same_bits(g2, torch.load(tmp_path / "grads1.pt")), "every rank applies the same summed gradient"
    assert any(g.abs().max() > 0 for g in g1.values()), "no gradient: the comparison would prove nothing"
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7)
    for m in ("reward_mean", "entropy", "loss", "grad_norm", "weight_delta_l2"):
        assert two[m] == pytest.approx(one[m], rel=1e-5, abs=1e-6), m
    # At world size 2 too, the update's forward as the scoring pass is the separate pass, bit for bit.
    scored = pd.read_csv(tmp_path / "two-scored" / "metrics.csv").set_index("metric")["value"]
    timing = two.index.str.startswith("time_") | (two.index == "tokens_per_s")
    assert two["time_score"] == 0 < scored["time_score"]
    pd.testing.assert_series_equal(two[~timing], scored[~timing], check_exact=True)
    for r in (0, 1):
        assert same_bits(torch.load(tmp_path / f"grads_scored{r}.pt"), g2)
    assert (tmp_path / "two-scored" / "step1_logprobs.npz").read_bytes() == \
        (tmp_path / "two" / "step1_logprobs.npz").read_bytes()


def test_the_readme_command_trains_under_torchrun(policy, tmp_path):
    """The README's command, `torchrun --nproc-per-node 2 -m workbench train ...`, on CPU: it exits 0, rank 0
    alone prints the table and writes the run folder, and the metrics hold every step."""
    import shutil
    import subprocess
    import sys

    import pandas as pd

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    out = tmp_path / "run"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "workbench", "train", "--device", "cpu",
           "--policy", policy, "--out-dir", str(out), "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
           "--max-new-tokens", "3", "--kernel-mode", "standard", "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"metrics: {out}/metrics.csv") == 1
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "metrics.csv",
                                                     "step1_logprobs.npz"]
    assert sorted(pd.read_csv(out / "metrics.csv").step.unique()) == [1, 2]

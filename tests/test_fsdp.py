"""The trainer with FSDP2 trainer ranks (`parallel='fsdp2'`, workbench/distributed/fsdp.py), in 2 gloo processes on
CPU started by `launch.spawn`, on the session's small arithmetic policy, 2 prompts x 2 completions a step in 4
mini-batches of one sequence (one rank holds it, the other runs a zero-loss micro-batch): the one-process log-probs
bit for bit and its gradient up to the summation order, each rank holding its half of the masters and AdamW state,
the gradient clipped to a global norm (over both ranks' shards) as in one process, split roles (1 FSDP2 trainer
rank + 1 rollout rank) equal to one process, two runs bitwise equal, a resume equal to
the uninterrupted run, the checkpoint loading whole at world size 1; the config errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from helpers import same_bits

from workbench.distributed import launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

TIMES = ("time_", "tokens_per_s", "sync_bytes")
"""Metrics that measure the run rather than the training (prefixes)."""


def _cfg(policy: str, out, **kw):
    from workbench.rl.config import TrainConfig

    base = TrainConfig(policy=policy, out_dir=str(out), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="invariant", checkpoint_every=1, lr=3e-3, progress=False, parallel="fsdp2",
                       sync="copy", policy_lag=1, mini_batches=4, max_grad_norm=1e-3)
    return dataclasses.replace(base, **kw)


def _recording(grads: list):
    """TrainWeights.step that first keeps the whole gradient it is about to apply (FSDP2: gathered from the shards,
    every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from workbench.rl.weights import TrainWeights

    step = TrainWeights.step

    def record(self):
        grads.append({k: m.grad.full_tensor() if isinstance(m.grad, DTensor) else m.grad.clone()
                      for k, m in self.masters.items()})
        return step(self)

    return record


def _masters(weights) -> dict[str, torch.Tensor]:
    return {k: m.detach().full_tensor() for k, m in weights.masters.items()}


def _check_shards_and_casts(weights, rank: int) -> dict[str, int]:
    """Each rank holds its share of every master and of AdamW's moments (FSDP2 splits the rows, the first rank
    taking an odd one), the bf16 model is the copy_weights cast of the whole masters, and the sharded module's bf16
    forward gives its log-probs bit for bit. Returns this rank's elements per master."""
    from torch.distributed.tensor import DTensor

    from workbench.distributed import fsdp
    from workbench.kernels import mode
    from workbench.models import build, copy_weights
    from workbench.rl.logprobs import completion_logprobs
    from workbench.rl.rollout import RolloutBatch

    masters = _masters(weights)
    mine = fsdp.local_sizes(weights.sharded)
    assert all(isinstance(m, DTensor) for m in weights.masters.values())
    for k, m in masters.items():
        rows = -(-m.shape[0] // 2) if rank == 0 else m.shape[0] // 2
        state = weights.opt.state[weights.masters[k]]
        assert mine[k] == rows * m[0].numel() == state["exp_avg"].to_local().numel() \
            == state["exp_avg_sq"].to_local().numel(), k
    ref = build(weights.model.config, dtype=torch.bfloat16, seed=None)
    copy_weights(masters, ref)
    assert same_bits(dict(ref.state_dict()), dict(weights.model.state_dict()))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mb = RolloutBatch([[1, 5, 7, 9], [1, 4]], [[3, 8], [6, 2, 2]], torch.zeros(2, 3), mask, 0).micro_batches(None, 64)
    with mode("invariant"):
        sharded, _ = completion_logprobs(weights.sharded, mb[0], 1.0)
        sharded.sum().backward()   # an FSDP2 forward is followed by its backward (the root reshards there)
        with torch.no_grad():
            plain, _ = completion_logprobs(weights.model, mb[0], 1.0)
    assert same_bits(sharded.detach(), plain)
    return mine


def _worker(policy: str, root: str) -> None:
    from pathlib import Path

    from workbench.rl import trainer
    from workbench.rl.weights import TrainWeights

    d = launch.init("cpu")
    out, runs, grads = Path(root), [], []
    init, step = trainer.TrainerRank.__init__, TrainWeights.step

    def keep(self, *args):
        init(self, *args)
        runs.append(self)

    trainer.TrainerRank.__init__ = keep
    TrainWeights.step = _recording(grads)
    trainer.train(_cfg(policy, out / "two"))   # invariant mode, colocated, one step
    TrainWeights.step = step
    mine = _check_shards_and_casts(runs[-1].weights, d.rank)
    masters = _masters(runs[-1].weights)
    # Split roles: rank 0 trains (FSDP2 over a group of one), rank 1 generates; 2 steps at policy lag 1.
    split = trainer.train(_cfg(policy, out / "split", steps=2, rollout_ranks=1))
    # Standard mode, 2 steps, synchronous: the same config twice, and a run stopped after step 1 and resumed.
    std = dict(kernel_mode="standard", sync="shared", policy_lag=0)
    tables = {"a": trainer.train(_cfg(policy, out / "a", steps=2, **std))}
    ends = {"a": _masters(runs[-1].weights)}
    tables["b"] = trainer.train(_cfg(policy, out / "b", steps=2, **std))
    ends["b"] = _masters(runs[-1].weights)
    trainer.train(_cfg(policy, out / "c", **std))
    tables["c"] = trainer.train(_cfg(policy, out / "c", steps=2, resume=True, **std))
    ends["c"] = _masters(runs[-1].weights)
    torch.save({"masters": masters, "grads": grads, "mine": mine, "split": split, "tables": tables, "ends": ends},
               out / f"rank{d.rank}.pt")


@pytest.mark.slow
def test_fsdp2_trainer_matches_one_process_and_resumes_bitwise(policy, tmp_path, monkeypatch):
    import numpy as np
    import pandas as pd
    from safetensors.torch import load_file

    from workbench.distributed.checkpoint import load
    from workbench.models import build, load_pretrained
    from workbench.rl.checkpoint import latest_checkpoint
    from workbench.rl.trainer import train
    from workbench.rl.weights import TrainWeights

    launch.spawn(_worker, 2, policy, str(tmp_path))
    grads = []
    monkeypatch.setattr(TrainWeights, "step", _recording(grads))
    one = train(_cfg(policy, tmp_path / "one", steps=2, parallel="replicate"))
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))

    def whole(folder) -> dict[str, torch.Tensor]:
        """An FSDP2 checkpoint's masters, loaded whole into a plain fp32 model here (world size 1: DCP reshards)."""
        model = build(load_pretrained(policy).config, dtype=torch.float32, seed=None)
        load(folder, model)
        return {k: v.detach() for k, v in model.state_dict().items()}

    # The same completions, and their log-probs the same bits on both sides and at both world sizes.
    lp1, lp2 = np.load(tmp_path / "one" / "step1_logprobs.npz"), np.load(tmp_path / "two" / "step1_logprobs.npz")
    for side in ("generator", "trainer"):
        assert lp2[side].tobytes() == lp1[side].tobytes() == lp2["generator"].tobytes()
    two = pd.read_csv(tmp_path / "two" / "metrics.csv").set_index("metric")["value"]
    first = one[one.step == 1].set_index("metric")["value"]
    assert two["parity_tokens_differing"] == 0 and two["response_length"] == first["response_length"]
    # The update: the one-process gradient up to the summation order (dW rounded to bf16 anywhere on its way would
    # be off by ~4e-3 relative), every rank applying the same; the masters after AdamW's steps as close. Every
    # mini-batch's gradient is clipped to norm 1e-3 (its norm is larger): a norm of each rank's shards alone, or no
    # clipping, would scale the 4 steps' gradients otherwise and move the masters by ~lr x 0.1.
    assert len(rank0["grads"]) == 4 and same_bits(rank0["grads"], rank1["grads"])
    assert any(g.abs().max() > 0 for step in grads[:4] for g in step.values())
    for g1, g2 in zip(grads[:4], rank0["grads"]):
        for k in g1:
            torch.testing.assert_close(g2[k], g1[k], rtol=1e-5, atol=1e-7)
    ones = load_file(tmp_path / "one" / "checkpoints" / "step-000001" / "masters.safetensors")
    assert same_bits(rank0["masters"], rank1["masters"])
    assert max(float((ones[k] - rank0["masters"][k]).abs().max()) for k in ones) < 1e-6
    for m in ("loss", "grad_norm", "weight_delta_l2"):
        assert two[m] == pytest.approx(first[m], rel=1e-5, abs=1e-6), m
    assert first["grad_norm"] > 1e-2, "the clipping at norm 1e-3 must be active"
    # Rank 0 holds the larger share: about half of the masters (and of AdamW's moments: checked on the ranks).
    total = sum(m.numel() for m in rank0["masters"].values())
    assert sum(rank0["mine"].values()) + sum(rank1["mine"].values()) == total
    assert sum(rank1["mine"].values()) <= sum(rank0["mine"].values()) < 0.51 * total

    # Split roles with one FSDP2 trainer rank: the one-process run with policy lag 1, its metrics, its masters and
    # lagged generator weights (the checkpoint loaded whole, in this process) bit for bit.
    assert rank1["split"].empty
    split, ref = (t.pivot(index="step", columns="metric", values="value") for t in (rank0["split"], one))
    kept = [c for c in ref.columns if not c.startswith(TIMES)]
    pd.testing.assert_frame_equal(split[kept], ref[kept])
    last = latest_checkpoint(tmp_path / "split")
    assert same_bits(whole(last), load_file(latest_checkpoint(tmp_path / "one") / "masters.safetensors"))
    assert same_bits(load_file(last / "generator.safetensors"),
                     load_file(latest_checkpoint(tmp_path / "one") / "generator.safetensors"))

    # Reproducible at world size 2, and the resumed run is the uninterrupted one, bit for bit; both ranks agree.
    a = rank0["tables"]["a"].pivot(index="step", columns="metric", values="value")
    kept = [c for c in a.columns if not c.startswith(TIMES)]
    assert list(a.index) == [1, 2] and (a["weight_delta_l2"] > 0).all()
    for name in ("b", "c"):
        other = rank0["tables"][name].pivot(index="step", columns="metric", values="value")
        pd.testing.assert_frame_equal(other[kept], a[kept])
        assert same_bits(rank0["ends"][name], rank0["ends"]["a"]), name
    assert same_bits(rank0["ends"], rank1["ends"])
    # The checkpoint is DCP's (each rank's shards, rank 0's files) and loads whole in one process.
    last = latest_checkpoint(tmp_path / "a")
    names = sorted(p.name for p in last.iterdir())
    assert "metrics.csv" in names and "masters.safetensors" not in names
    assert sum(n.endswith(".distcp") for n in names) == 2
    assert same_bits(whole(last), rank0["ends"]["a"])


def test_fsdp2_config_errors_say_what_to_set(policy, tmp_path):
    from workbench.rl.trainer import train

    with pytest.raises(ValueError, match="parallel='fsdp2' shards the trainer over torchrun's processes: launch "
                                         "with torchrun"):
        train(_cfg(policy, tmp_path / "x"))
    for kw in ({"adapter": "lora"}, {"master_dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="parallel='fsdp2' shards the fp32 masters of full fine-tuning.*"
                                             "or parallel='replicate'"):
            _cfg(policy, tmp_path / "y", **kw)
    with pytest.raises(ValueError, match="parallel must be 'replicate' or 'fsdp2'"):
        _cfg(policy, tmp_path / "z", parallel="fsdp")

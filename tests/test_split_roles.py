"""Split roles under torchrun (workbench/distributed/pipeline.py): rank 0 trains, rank 1 only generates, in 2 gloo
processes on CPU started by `launch.spawn`, on the session's small arithmetic policy, 2 prompts x 2 completions a
step. In invariant mode the run is the one-process run, bit for bit (synchronous, and with policy_lag=1, where the
rollout rank really generates step s + 1 while rank 0 updates on step s); a resumed run is the uninterrupted one;
a parity break, a corrupted weight sync and a bad config stop both ranks with the same error. In 3 processes: with 2
FSDP2 trainer ranks and a rollout rank the samples are one process's and the update its update up to summation
order; with one trainer rank and 2 rollout ranks (the weights broadcast to both, the step's rows from both) the run
is one process's bit for bit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
from helpers import logprobs_off, same_bits, seed_for
from safetensors.torch import load_file

from workbench.config import get_setting
from workbench.distributed import launch

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

SPLIT_ONLY = ("time_rollout_wait", "time_trainer_wait", "time_overlap")
"""Metrics a run with split roles adds (the rollout ranks' waits, the trainer's wait, the overlap); its time_score is
the rollout ranks' scoring."""


def _cfg(policy: str, out, **kw):
    from workbench.rl.config import TrainConfig

    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="invariant", checkpoint_every=1, lr=3e-3, progress=False, sync="copy",
                       rollout_ranks=1)
    return dataclasses.replace(base, **kw)


def _one_process(policy: str, runs: dict[Path, dict], log: Path) -> subprocess.Popen:
    """The same runs without torchrun (rollout_ranks=0), into each key's folder with its settings, one after another
    through the command line's `main` in a process of its own beside the split run (which leaves a core idle while
    its trainer waits for samples; one process start-up for all of them); its output goes to `log`."""
    names = ("policy", "out_dir", "steps", "prompts_per_step", "group_size", "max_new_tokens", "kernel_mode",
             "checkpoint_every", "lr", "sync", "policy_lag", "rollout_ranks", "parity_sample")
    argvs = []
    for out, kw in runs.items():
        cfg = _cfg(policy, out, rollout_ranks=0, **kw)
        argvs.append(["train", "--no-progress", *(f"{n}={get_setting(cfg, n)}" for n in names)])
    code = (f"import sys\nfrom workbench.__main__ import main\nfor argv in {argvs!r}:\n"
            "    if main(argv) != 0:\n        sys.exit(1)\n")
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT)


def _split_worker(policy: str, root: str) -> None:
    from workbench.distributed import broadcast
    from workbench.distributed.data_parallel import DataParallel
    from workbench.rl import samplers
    from workbench.rl.trainer import ParityError, train

    d = launch.init("cpu")
    out = Path(root)
    # DataParallel over a group of its own (the trainer ranks'): every collective runs over that group.
    both, alone = DataParallel(d, group=dist.new_group([0, 1])), dist.new_group([0])
    assert (both.rank, both.world_size) == (d.rank, 2) and both.gather_objects([d.rank]) == [0, 1]
    assert both.sum(torch.tensor([1.0])).item() == 2.0 and both.any(d.rank == 1)
    with pytest.raises((ZeroDivisionError, RuntimeError), match="division by zero"):
        both.on_main(lambda: 1 / 0)
    if d.rank == 0:
        solo = DataParallel(d, group=alone)
        assert solo.world_size == 1 and solo.shard(3) == slice(0, 3) and solo.max([2.0]) == [2.0]
    # Invariant mode: synchronous (1 step), and policy_lag=1 (2 steps: step 2 samples with the weights before
    # step 1's update while the trainer updates on step 1; the rollout rank recomputes 2 of step 2's 4 completions).
    # Policy lag 2, 4 steps: step 4 samples with version 1, which rank 0 sends from its kept copies.
    tables = {"sync": train(_cfg(policy, out / "sync", steps=1)),
              "lag": train(_cfg(policy, out / "lag", policy_lag=1, parity_sample=2)),
              "lag2": train(_cfg(policy, out / "lag2", policy_lag=2, steps=4))}
    if d.rank == 0:
        torch.save(tables, out / "tables.pt")
    else:
        assert all(t.empty for t in tables.values()), "a rollout rank keeps no metrics"

    # Standard mode, policy_lag=1: a time limit stops the run after step 1 (the rollout rank, already generating
    # step 2, is drained and stopped), and the resumed run equals the uninterrupted one.
    std = dict(kernel_mode="standard", policy_lag=1, steps=3)
    full = train(_cfg(policy, out / "full", **std))
    first = train(_cfg(policy, out / "resumed", time_limit_s=1e-9, **std))
    resumed = train(_cfg(policy, out / "resumed", resume=True, **std))
    if d.rank == 0:
        assert sorted(first.step.unique()) == [1]
        torch.save({"full": full, "resumed": resumed}, out / "resume.pt")

    # A parity break on the rollout rank (its log-probs off by 1e-3): both ranks stop with the trainer's ParityError,
    # the rollout rank after its share of step 2 (ordered before step 1's check) is drained.
    generate = samplers.generate
    if d.rank == 1:
        samplers.generate = logprobs_off(generate)
    with pytest.raises(ParityError, match=r"step 1: generator and trainer log-probs differ on \d+ of"):
        train(_cfg(policy, out / "broken", policy_lag=1))
    samplers.generate = generate

    # One bit of the rollout rank's copy flipped in the second sync (version 1): the digest check names it, on both.
    unpack, calls = broadcast._unpack, []

    def corrupting(pieces, buf):
        unpack(pieces, buf)
        calls.append(1)
        if len(calls) == 2:
            view, start, _, _ = pieces[0]
            view[start:start + 1].bitwise_xor_(1)

    if d.rank == 1:
        broadcast._unpack = corrupting
    with pytest.raises(RuntimeError, match=r"version 1\): ranks \[1\] hold other bits than source rank 0.*"
                                           r"model\.embed_tokens\.weight"):
        train(_cfg(policy, out / "corrupt", kernel_mode="standard", steps=3))
    broadcast._unpack = unpack

    with pytest.raises(ValueError, match="rollout_ranks=2 leaves no trainer rank in a world of 2: use at most 1"):
        train(_cfg(policy, out / "none", rollout_ranks=2))


def _metrics(table: pd.DataFrame | Path) -> pd.DataFrame:
    """The metrics that are the same bits in equal runs, by step: not the times, nor the bytes a sync moved (a split
    run broadcasts what one process copies, and a resumed one sends its lagged weights at its start)."""
    if isinstance(table, Path):
        # float() reads a value back exactly; pandas' default parser may be off by an ulp
        table = pd.read_csv(table / "metrics.csv", converters={"value": float})
    by = table.pivot(index="step", columns="metric", values="value")
    return by.loc[:, ~(by.columns.str.startswith("time_") | by.columns.isin(["tokens_per_s", "sync_bytes"]))]


@pytest.mark.slow
def test_split_roles_match_one_process_bitwise_overlap_resume_and_stop_together(policy, tmp_path):
    one = _one_process(policy, {tmp_path / "one_sync": dict(steps=1),
                                tmp_path / "one_lag": dict(policy_lag=1, parity_sample=2),
                                tmp_path / "one_lag2": dict(policy_lag=2, steps=4)}, tmp_path / "one.log")
    launch.spawn(_split_worker, 2, policy, str(tmp_path))
    assert one.wait(timeout=600) == 0, (tmp_path / "one.log").read_text()[-3000:]

    for name in ("sync", "lag", "lag2"):
        split, single = tmp_path / name, tmp_path / f"one_{name}"
        # The rollout rank sampled the same tokens with the same log-probs, and the trainer computed the same bits.
        pd.testing.assert_frame_equal(_metrics(split), _metrics(single))
        assert (_metrics(split)["parity_tokens_differing"] == 0).all()
        a, b = np.load(split / "step1_logprobs.npz"), np.load(single / "step1_logprobs.npz")
        for side in ("generator", "trainer"):
            assert a[side].tobytes() == b[side].tobytes() == b["generator"].tobytes()
        # The same weights after each step (both checkpoints kept), the lagged generator's too.
        steps = sorted(p.name for p in (single / "checkpoints").iterdir())
        assert steps == sorted(p.name for p in (split / "checkpoints").iterdir())
        for step in steps:
            lagged = {"sync": (), "lag": ("generator.safetensors",),
                      "lag2": ("generator.safetensors", "generator-1.safetensors")}[name]
            for f in ("masters.safetensors", *lagged):
                assert same_bits(load_file(split / "checkpoints" / step / f),
                                 load_file(single / "checkpoints" / step / f)), (name, step, f)
        # Rank 0 alone wrote the run's files, in the one-process layout.
        assert sorted(p.name for p in split.iterdir()) == ["checkpoints", "config.yaml", "metrics.csv",
                                                          "step1_logprobs.npz"]

    tables = torch.load(tmp_path / "tables.pt", weights_only=False)
    lag = tables["lag"].pivot(index="step", columns="metric", values="value")
    assert list(lag["policy_lag"]) == [0, 1] and lag["weight_delta_l2"][1] > 0, "step 2 sampled with moved weights"
    tokens = 4 * lag["response_length"]   # the step's completion tokens (2 prompts x 2)
    assert lag["parity_tokens_checked"][1] == tokens[1] and 0 < lag["parity_tokens_checked"][2] < tokens[2]
    lag2 = tables["lag2"].pivot(index="step", columns="metric", values="value")
    assert list(lag2["policy_lag"]) == [0, 1, 2, 2] and lag2["weight_delta_l2"][1] > 0, "step 4: moved weights"
    # The overlap is real: the rollout rank generated step 2 while rank 0 trained on step 1 (wall-clock spans).
    assert lag["time_overlap"][2] > 0.5 * min(lag["time_generate"][2], lag["time_train"][1])
    synchronous = tables["sync"].set_index("metric")["value"]
    assert synchronous["time_overlap"] == 0 and synchronous["time_trainer_wait"] > 0
    assert set(SPLIT_ONLY) | {"time_score"} <= set(lag.columns)

    runs = torch.load(tmp_path / "resume.pt", weights_only=False)
    pd.testing.assert_frame_equal(_metrics(runs["resumed"]), _metrics(runs["full"]))
    assert same_bits(load_file(tmp_path / "resumed/checkpoints/step-000003/masters.safetensors"),
                     load_file(tmp_path / "full/checkpoints/step-000003/masters.safetensors"))


def test_bad_split_configs_say_what_to_set(policy, tmp_path, monkeypatch):
    from workbench.rl.config import TrainConfig
    from workbench.rl.trainer import train

    for v in launch.TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ValueError, match=r"rollout_ranks=1 needs processes of their own.*torchrun --nproc-per-node N "
                                         r"\(N > 1\), or set rollout_ranks=0"):
        train(_cfg(policy, tmp_path / "alone"))
    assert not (tmp_path / "alone").exists()
    with pytest.raises(ValueError, match="generator='vllm' with rollout_ranks > 0 is not supported yet.*use "
                                         "generator='embedded'"):
        TrainConfig(generator="vllm", sync="copy", rollout_ranks=1)
    with pytest.raises(ValueError, match="rollout_ranks=1 keeps the generators in processes of their own.*use "
                                         "sync='copy'"):
        TrainConfig(rollout_ranks=1)
    with pytest.raises(ValueError, match="adapter='lora' with rollout_ranks > 0 is not supported yet"):
        TrainConfig(rollout_ranks=1, sync="copy", adapter="lora")
    with pytest.raises(ValueError, match="rollout_ranks must be an integer >= 0"):
        TrainConfig(rollout_ranks=-1)


def _three_worker(policy: str, root: str) -> None:
    from workbench.rl.trainer import train

    launch.init("cpu")
    train(_cfg(policy, Path(root) / "three", policy_lag=1, parallel="fsdp2"))
    train(_cfg(policy, Path(root) / "two_rollouts", policy_lag=1, rollout_ranks=2, parity_sample=2))


@pytest.mark.slow
def test_three_ranks_two_trainers_or_two_rollout_ranks(policy, tmp_path):
    """3 processes, policy lag 1. First ranks 0 and 1 train with FSDP2 over their own group of 2, rank 2 generates.
    Every step samples with weights both runs hold bit for bit (step 2 with the start's, one update behind), so
    what the samples decide is the one-process run's exactly; the update is its gradient up to summation order.
    Then rank 0 trains alone and ranks 1 and 2 generate a prompt each, each recomputing 1 of its 2 completions at
    step 2 (parity_sample=2): one process's run, bit for bit, the weights included (the sync went to both rollout
    ranks, and their shares came back in the step's row order), but for the parity and entropy metrics of step 2,
    which are those of the rows checked."""
    from workbench.distributed.checkpoint import load
    from workbench.models import build, load_pretrained
    from workbench.rl.checkpoint import latest_checkpoint

    single = _one_process(policy, {tmp_path / "one": dict(policy_lag=1)}, tmp_path / "one.log")
    launch.spawn(_three_worker, 3, policy, str(tmp_path))
    assert single.wait(timeout=600) == 0, (tmp_path / "one.log").read_text()[-3000:]
    three, one = _metrics(tmp_path / "three"), _metrics(tmp_path / "one")
    sampled = ["reward_mean", "response_length", "parity_max_abs_diff", "parity_tokens_differing", "sampler_trainer_kl",
               "policy_lag"]
    pd.testing.assert_frame_equal(three[sampled], one[sampled], check_exact=True)
    assert list(three["policy_lag"]) == [0, 1] and (three["parity_tokens_differing"] == 0).all()
    for m in ("loss", "grad_norm", "weight_delta_l2"):
        np.testing.assert_allclose(three[m], one[m], rtol=1e-5, atol=1e-7, err_msg=m)
    a, b = np.load(tmp_path / "three" / "step1_logprobs.npz"), np.load(tmp_path / "one" / "step1_logprobs.npz")
    for side in ("generator", "trainer"):
        assert a[side].tobytes() == b[side].tobytes()
    model = build(load_pretrained(policy).config, dtype=torch.float32, seed=None)
    load(latest_checkpoint(tmp_path / "three"), model)   # the 2 ranks' DCP shards, whole in this process
    ref = load_file(latest_checkpoint(tmp_path / "one") / "masters.safetensors")
    assert max(float((ref[k] - v).abs().max()) for k, v in model.state_dict().items()) < 1e-6

    split = tmp_path / "two_rollouts"
    sample = _metrics(split)
    pd.testing.assert_frame_equal(sample.loc[[1]], one.loc[[1]])
    alike = [c for c in one.columns if not c.startswith(("parity_", "entropy", "sampler_trainer_kl", "is_ess",
                                                             "seq_"))]
    pd.testing.assert_frame_equal(sample[alike], one[alike])
    assert sample["parity_tokens_differing"][2] == 0 < sample["parity_tokens_checked"][2] < \
        one["parity_tokens_checked"][2] == 4 * one["response_length"][2]
    a = np.load(split / "step1_logprobs.npz")
    assert all(a[side].tobytes() == b["generator"].tobytes() for side in ("generator", "trainer"))
    assert same_bits(load_file(latest_checkpoint(split) / "masters.safetensors"), ref)


def test_samples_travel_packed_and_come_back_whole():
    """A share's completions cross the wire with their tensor fields packed into one flat tensor a field; after a
    pickle round trip each completion has its own values back, of random lengths (0 included)."""
    import pickle

    from workbench.distributed.pipeline import _pack, _unpack
    from workbench.generation.generator import Completion

    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(0, 9, (7,), generator=g)] + [0]
    items = [Completion(i, [1, 2, i], list(range(n)), torch.randn(n, generator=g), torch.randn(n, generator=g),
                        "stop" if n % 2 else "length") for i, n in enumerate(lengths)]
    bare, columns = _pack(items)
    assert sorted(columns) == ["logprobs", "sampled_logprobs"] and all(x.logprobs is None for x in bare)
    back = _unpack(*pickle.loads(pickle.dumps((bare, columns))))
    for a, b in zip(items, back, strict=True):
        assert (a.request_id, a.prompt, a.tokens, a.finish_reason) == (b.request_id, b.prompt, b.tokens,
                                                                       b.finish_reason), f"seed {seed}"
        assert same_bits({"l": a.logprobs, "s": a.sampled_logprobs}, {"l": b.logprobs, "s": b.sampled_logprobs}), \
            f"seed {seed}"
    assert _pack([]) == ([], {}) and _pack([3, 4]) == ([3, 4], {})

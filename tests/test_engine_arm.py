"""The realistic OFF arm: an engine's kernels generating beside a standard trainer mismatch at any shape, where the
same standard kernels on both sides (`off-shapes`) can agree; and the sequence log-ratio statistics."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import seed_for
from workbench.onoff.arms import ARMS, arm_settings
from workbench.rl.config import TrainConfig
from workbench.rl.logprobs import parity_stats
from workbench.rl.trainer import train


def _step1(policy, out, arm: str) -> dict:
    cfg = TrainConfig(policy=policy, out_dir=str(out), steps=1, prompts_per_step=2, group_size=2, max_new_tokens=3,
                      checkpoint_every=1, **{k: v for k, v in arm_settings(arm, False).items()})
    table = train(cfg)
    return table.set_index("metric")["value"].to_dict()


def test_engine_arm_mismatches_where_same_kernels_agree(policy, tmp_path):
    """The negative control of the control: at the tiny model's shapes the standard kernels agree with themselves
    (only the products' shapes differ, and the CPU BLAS sums K in one order), while the engine's fused, once-rounded
    norms, SiLU and RoPE differ from the trainer's Hugging Face formulas in every layer."""
    shapes = _step1(policy, tmp_path / "shapes", "off-shapes")
    engine = _step1(policy, tmp_path / "engine", "off")
    assert engine["parity_tokens_differing"] > 0 and engine["sampler_trainer_kl"] > 0, engine
    assert engine["parity_mean_abs_diff"] > 10 * shapes["parity_mean_abs_diff"], (engine, shapes)


def test_off_arms_run_an_engine_and_off_shapes_does_not():
    for name in ("off", "off-recompute", "off-tis", "off-mis"):
        assert ARMS[name].sampler_kernels == "engine", name
        assert arm_settings(name, True)["sampler_kernels"] == "engine"
    assert ARMS["off-shapes"].sampler_kernels == "trainer" and ARMS["on"].sampler_kernels == "trainer"


@pytest.mark.parametrize("bad, match", [({"kernel_mode": "invariant"}, "kernel_mode='standard'"),
                                        ({"sampler_kernels": "vllm"}, "sampler_kernels must be")])
def test_engine_kernels_need_a_standard_trainer(bad, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"kernel_mode": "standard", "sampler_kernels": "engine", **bad})


def test_sequence_log_ratio_spread_and_clip_share():
    seed = seed_for()
    g = torch.Generator().manual_seed(seed)
    b, t = 64, 40
    sampler = -torch.rand(b, t, generator=g) * 3
    delta = torch.randn(b, t, generator=g) * 0.05
    lens = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    trainer = sampler + delta
    stats = parity_stats(sampler, trainer, mask)
    seq = ((trainer - sampler) * mask).double().sum(1)
    assert math.isclose(stats["seq_logratio_sd"], float(seq.std()), rel_tol=1e-9), f"seed {seed}"
    outside = float((seq.abs() > math.log(1.2)).double().mean())
    assert stats["seq_ratio_outside_1.2"] == outside, f"seed {seed}"
    same = parity_stats(sampler, sampler.clone(), mask)
    assert same["seq_logratio_sd"] == 0 and same["seq_ratio_outside_1.2"] == 0 and same["ess"] == 1.0


def test_gpu_slots_spread_workers_over_the_gpus(monkeypatch):
    import contextlib
    import multiprocessing

    from workbench.onoff import runner

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with contextlib.ExitStack() as stack:
        slots = runner._gpu_slots(stack, multiprocessing.get_context("spawn"), 7, "cuda")
        taken = sorted(slots.get() for _ in range(7))
    assert taken == [0, 0, 0, 1, 1, 2, 2]
    assert runner._gpu_slots(contextlib.ExitStack(), None, 4, "cpu") is None


def test_probe_measures_each_arm_at_each_length(policy, tmp_path):
    from workbench.onoff.config import OnOffConfig
    from workbench.onoff.probe import probe

    cfg = OnOffConfig(policy=policy, out_dir=str(tmp_path), arms=("off-shapes", "off"), seeds=(0,),
                      prompts_per_step=2, group_size=2, device="cpu", progress=False)
    table = probe(cfg, steps=1, lengths=(2, 4))
    assert sorted(zip(table.max_new_tokens, table.arm)) == [(2, "off"), (2, "off-shapes"), (4, "off"),
                                                           (4, "off-shapes")]
    assert (table.steps == 1).all() and table.response_length.between(1, 4).all()
    by = table.set_index(["max_new_tokens", "arm"])
    assert (by.loc[(4, "off"), "sampler_trainer_kl"] > 0).all()
    again = probe(cfg, steps=1, lengths=(2,))   # a finished probe is read, not run again
    assert again.drop(columns="time_step").equals(table[table.max_new_tokens == 2].drop(columns="time_step")
                                                  .reset_index(drop=True))

"""The trainer on a real GPU: zero differing tokens at every step in invariant mode (skipped without CUDA)."""

import pandas as pd
import pytest

from workbench.rl.config import TrainConfig
from workbench.rl.trainer import train

pytestmark = pytest.mark.gpu


def test_gpu_grpo_steps_hold_parity_and_resume(tmp_path):
    cfg = TrainConfig(out_dir=str(tmp_path / "inv"), steps=4, prompts_per_step=8, group_size=4, max_new_tokens=3,
                      kernel_mode="invariant", checkpoint_every=2, device="cuda")
    table = train(cfg)
    parity = table[table.metric == "parity_tokens_differing"]
    assert len(parity) == 4 and (parity.value == 0).all()
    ratio = table[table.metric == "ratio_mean"].value
    assert (ratio == 1.0).all(), [repr(v) for v in ratio]
    standard = train(TrainConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "std"), "kernel_mode": "standard",
                                    "policy": str(tmp_path / "inv" / "policy")}))
    differing = standard[standard.metric == "parity_tokens_differing"].value
    assert len(differing) == 4 and differing.sum() > 0, "the standard control must measure a mismatch on the GPU"


def test_gpu_ppo_mini_batches_and_the_old_logprobs_source(tmp_path):
    base = dict(steps=3, prompts_per_step=8, group_size=4, max_new_tokens=3, checkpoint_every=3, device="cuda",
                mini_batches=2, epochs=2, lr=3e-3, max_tokens_per_microbatch=40, activation_checkpointing="layers")
    inv = train(TrainConfig(out_dir=str(tmp_path / "inv"), kernel_mode="invariant", old_logprobs="sampler", **base))
    by = inv.pivot(index="step", columns="metric", values="value")
    assert (by["parity_tokens_differing"] == 0).all() and (by["optimizer_steps"] == 4).all()
    assert (by["ratio_mean"] != 1.0).any(), "from the second mini-batch on the ratio leaves 1"
    policy = str(tmp_path / "inv" / "policy")
    # The standard runs' sampler carries a mismatch of known size (`sampler_noise`): on this tiny model the kernels'
    # own is an fp32 ulp or two of the log-probs (parity_max_abs_diff 2.4e-7 on the H100, 2026-11-26), which
    # exp() and the ratio's fp32 mean round away (the gradient came out the same bits from either source).
    std = {src: train(TrainConfig(out_dir=str(tmp_path / src), kernel_mode="standard", old_logprobs=src,
                                  policy=policy, sampler_noise=0.1, **{**base, "mini_batches": 1, "epochs": 1}))
           for src in ("recompute", "sampler")}
    ratio = {src: t[t.metric == "ratio_mean"].value for src, t in std.items()}
    # recompute: the ratio compares the standard trainer with itself (its no-grad pass and its training forward,
    # which need not give the same bits: only invariant mode promises that), so it stays near 1; sampler: the
    # sampler's log-probs are the ratio's denominator, so its mismatch enters the ratio.
    assert ((ratio["recompute"] - 1).abs() < 1e-3).all(), list(ratio["recompute"])
    assert ((ratio["sampler"] - 1).abs() > 1e-3).any(), list(ratio["sampler"])


def test_gpu_blog_recipe_is_exactly_on_policy_only_when_on(tmp_path):
    """The blog preset's loss on bf16 weights with the sampler's old log-probs: `on` has ratio exactly 1 and its
    KL term exactly 0 at every step; `off` carries the kernels' mismatch into that ratio."""
    from workbench.onoff.config import preset
    from workbench.onoff.runner import run_on_off

    cfg = preset("blog", smoke=True, out_dir=str(tmp_path), device="cuda", arms=("on", "off"), steps=3,
                 progress=False)
    by = run_on_off(cfg).pivot_table(index=["variant", "step"], columns="metric", values="value")
    on, off = by.loc["on"], by.loc["off"]
    assert (on.parity_tokens_differing == 0).all() and (on.seq_ratio_mean == 1.0).all() and (on.seq_kl == 0).all()
    assert (on.is_ess == 1.0).all()
    assert off.parity_tokens_differing.sum() > 0 and (off.seq_ratio_mean != 1.0).any()


def _odd_length(self, completion: str, problem) -> float:
    """A reward a random policy's completions vary in (whether the text's length is odd): the task's exact match
    gives every random completion 0, hence zero advantages and weights that never move."""
    return float(len(completion) % 2)


@pytest.mark.slow
def test_gpu_the_update_scores_the_step_bit_for_bit_at_the_real_shape(tmp_path, monkeypatch):
    """`train` at the Qwen3-1.7B shape (random weights; the arithmetic tokenizer's 17 tokens in a vocabulary of 32, as
    test_gpu_titan_tp, so completions vary and stop), 2 steps of 16 prompts x 8 x up to 256 tokens: the update's
    forward scores each step (time_score 0) with 0 differing tokens, and the masters, the bf16 model and every
    metric are the same run's through the separate no-grad scoring pass, bit for bit."""
    import dataclasses
    import gc

    import torch
    from helpers import random_gpu_model, same_bits

    from workbench.models import config, save_pretrained
    from workbench.rl import scoring
    from workbench.policies.selftrained import train_tokenizer
    from workbench.rl.run import TrainerRank
    from workbench.tasks import Arithmetic

    model = random_gpu_model(dataclasses.replace(config("qwen3-1.7B"), vocab_size=32, max_position_embeddings=4096),
                             seed=1)
    save_pretrained(model, tmp_path / "policy", tokenizer=train_tokenizer(Arithmetic(seed=0)))
    del model
    torch.cuda.empty_cache()
    monkeypatch.setattr(Arithmetic, "reward", _odd_length)
    # No 1.7B checkpoint (AdamW state: 20 GB) on disk.
    monkeypatch.setattr(TrainerRank, "checkpoint", lambda self, step: None)
    runs, init = [], TrainerRank.__init__

    def keep(self, *args):
        init(self, *args)
        runs.append(self)

    monkeypatch.setattr(TrainerRank, "__init__", keep)
    tables, weights = {}, {}
    for name in ("folded", "score-pass"):
        if name == "score-pass":
            monkeypatch.setattr(scoring, "scores_in_update", lambda *args: False)
        tables[name] = train(TrainConfig(
            policy=str(tmp_path / "policy"), chat_template=False, out_dir=str(tmp_path / name), steps=2,
            prompts_per_step=16, group_size=8, max_new_tokens=256, lr=1e-5, kernel_mode="invariant",
            checkpoint_every=10**6, device="cuda", progress=False)).pivot(index="step", columns="metric", values="value")
        w = runs.pop().weights
        weights[name] = ({k: v.detach().cpu() for k, v in w.masters.items()},
                         {k: v.cpu() for k, v in w.model.state_dict().items()})
        del w
        gc.collect()
        torch.cuda.empty_cache()
    folded, scored = tables["folded"], tables["score-pass"]
    print(pd.DataFrame({n: t[["time_score", "time_train", "time_step"]].iloc[-1] for n, t in tables.items()}))
    assert (folded["parity_tokens_differing"] == 0).all() and (scored["parity_tokens_differing"] == 0).all()
    assert (folded["time_score"] == 0).all() and (scored["time_score"] > 0).all()
    assert (folded["reward_std"] > 0).all() and (folded["weight_delta_l2"] > 0).all(), "the weights did not move"
    kept = [c for c in scored.columns if not c.startswith(("time_", "tokens_per_s"))]
    pd.testing.assert_frame_equal(folded[kept], scored[kept], check_exact=True)
    assert same_bits(weights["folded"], weights["score-pass"]), "the masters or the bf16 model differ"
    lp = [(tmp_path / name / "step1_logprobs.npz").read_bytes() for name in tables]
    assert lp[0] == lp[1], "step 1's log-probs file differs"

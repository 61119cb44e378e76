"""The parity check on a sample of the completions (`TrainConfig.parity_sample`, where a separate pass scores them):
in invariant mode the run is the fully checked run, bit for bit, in its weights and in every metric but the parity
and entropy ones, which cover the rows recomputed (all of step 1's); a kernel break at a later step is still caught
on them; the settings where the skipped rows' log-probs are not the trainer's are refused. The split-roles path is in
test_split_roles.py."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from helpers import logprobs_off, same_bits, seed_for

from workbench.kernels import mode
from workbench.rl import samplers
from workbench.rl.config import TrainConfig
from workbench.rl.run import TrainerRank
from workbench.tasks import Arithmetic
from workbench.rl.trainer import ParityError, train, train_step

CHECKED = ("parity_", "entropy", "sampler_trainer_kl", "is_ess", "seq_")
"""The metrics of the rows checked."""
TIMES = ("time_", "tokens_per_s")


def _cfg(policy, out, **kw):
    # Policy lag 1: the lagged generator's weights are scored by a separate pass (the update cannot be it).
    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="invariant", checkpoint_every=2, lr=3e-3, progress=False, sync="copy",
                       policy_lag=1)
    return dataclasses.replace(base, **kw)


def _text_reward(self, completion: str, problem) -> float:
    """A reward that differs between any two texts, so the weights move (see test_score_in_update.py)."""
    return zlib.crc32(completion.encode()) / 2**32


@pytest.mark.slow
def test_a_sampled_check_trains_the_same_bits_and_catches_a_break_on_its_rows(policy, tmp_path, monkeypatch):
    seed = seed_for(bound=2**16)
    monkeypatch.setattr(Arithmetic, "reward", _text_reward)
    runs, init = [], TrainerRank.__init__
    monkeypatch.setattr(TrainerRank, "__init__", lambda self, *args: (init(self, *args), runs.append(self))[0])
    full, half = (train(_cfg(policy, tmp_path / name, seed=seed, parity_sample=n)).pivot(
        index="step", columns="metric", values="value") for name, n in (("full", 1), ("half", 2)))
    assert (half["weight_delta_l2"] > 0).all() and (half["parity_tokens_differing"] == 0).all(), f"seed {seed}"
    same = [c for c in full.columns if not c.startswith(CHECKED + TIMES)]
    assert sorted(same) == sorted(c for c in half.columns if not c.startswith(CHECKED + TIMES)), f"seed {seed}"
    for m in same:   # loss, rewards, KL-free ratios, gradient norms, ...: the old log-probs were the same bits
        assert same_bits(torch.tensor(full[m].values), torch.tensor(half[m].values)), f"seed {seed}: {m}"
    for m in (c for c in full.columns if c.startswith(CHECKED)):
        assert same_bits(torch.tensor(full[m][1]), torch.tensor(half[m][1])), f"seed {seed}: step 1 checks all: {m}"
    tokens = 4 * full["response_length"]   # 2 prompts x 2 completions a step
    assert (full["parity_tokens_checked"] == tokens).all(), f"seed {seed}"
    assert 0 < half["parity_tokens_checked"][2] < tokens[2], f"seed {seed}"
    a, b = (r.weights for r in runs)
    assert same_bits(*({k: v.detach() for k, v in w.masters.items()} for w in (a, b))), f"seed {seed}: masters"
    assert (tmp_path / "full/step1_logprobs.npz").read_bytes() == (tmp_path / "half/step1_logprobs.npz").read_bytes()

    # Step 3 of the sampled run with the generator's log-probs all off by 1e-3 (a broken kernel moves every row):
    # the check stops it, counting the tokens of the rows it recomputed.
    monkeypatch.setattr(samplers, "generate", logprobs_off(samplers.generate))
    with mode("invariant"), pytest.raises(ParityError, match=r"^step 3: generator and trainer log-probs differ on "
                                                             r"(\d+) of \1 tokens"):
        train_step(runs[1], 3)
    logged = runs[1].log.table().query("step == 3").set_index("metric")["value"]
    assert 0 < logged["parity_tokens_checked"] < 4 * 3, f"seed {seed}: 1 completion in 2, at most 3 tokens each"


@pytest.mark.parametrize("kw", [dict(kernel_mode="standard"), dict(sampler_noise=0.1), dict(parity="warn"),
                                dict(generator="vllm", vllm_model="vllm")])
def test_a_sample_is_refused_where_the_skipped_rows_are_not_the_trainers_bits(kw):
    with pytest.raises(ValueError, match=r"parity_sample=2 takes the generator's log-probs .* set parity_sample=1"):
        TrainConfig(parity_sample=2, sync="copy", **kw)
    with pytest.raises(ValueError, match="parity_sample must be an integer >= 1"):
        TrainConfig(parity_sample=0)
    with pytest.raises(ValueError, match="parity_sample=9 exceeds the step's 8 completions"):
        TrainConfig(parity_sample=9, prompts_per_step=2, group_size=4)

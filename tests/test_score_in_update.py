"""The update's forward as the step's scoring pass (`scoring.scores_in_update`): in invariant mode a run that folds the
scoring into the update is the run through the separate no-grad pass, bit for bit (weights, metrics, step-1
log-probs), and a parity break still stops it before the optimizer step, with today's message."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from helpers import same_bits, seed_for

from workbench.kernels import mode
from workbench.rl import scoring
from workbench.rl import step as step_module
from workbench.rl.config import TrainConfig
from workbench.rl.run import TrainerRank
from workbench.tasks import Arithmetic
from workbench.rl.trainer import ParityError, train, train_step

TIMES = ("time_", "tokens_per_s")


def _cfg(policy, out, **kw):
    base = TrainConfig(policy=policy, out_dir=str(out), steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3,
                       kernel_mode="invariant", checkpoint_every=2, lr=3e-3, progress=False)
    return dataclasses.replace(base, **kw)


def _scoring_calls(monkeypatch) -> list:
    """Every model `score` runs, in order (the policy's scoring pass, or a KL reference's)."""
    calls, score = [], step_module.score

    def spy(model, *args, **kw):
        calls.append(model)
        return score(model, *args, **kw)

    monkeypatch.setattr(step_module, "score", spy)
    monkeypatch.setattr(scoring, "score", spy)
    return calls


def _kept_runs(monkeypatch) -> list[TrainerRank]:
    runs, init = [], TrainerRank.__init__

    def keep(self, *args):
        init(self, *args)
        runs.append(self)

    monkeypatch.setattr(TrainerRank, "__init__", keep)
    return runs


def _text_reward(self, completion: str, problem) -> float:
    """A reward in [0, 1) that differs between any two different texts (a hash of the text), so that a group whose
    completions differ has advantages and the weights move (the exact-match reward ties whole groups often)."""
    return zlib.crc32(completion.encode()) / 2**32


@pytest.mark.parametrize("kw", [
    # A KL in the loss (the reference still scores), clipped, the MLPs recomputed in the backward.
    dict(kl_coef=0.05, kl_to="reference", max_grad_norm=0.5, activation_checkpointing="mlp"),
    pytest.param(dict(trainer_backend="torchtitan", activation_checkpointing="layers"), marks=pytest.mark.slow),
], ids=["workbench", "torchtitan"])
def test_the_folded_update_is_the_score_pass_bit_for_bit(policy, tmp_path, monkeypatch, kw):
    if kw.get("trainer_backend") == "torchtitan":
        pytest.importorskip("torchtitan")
    seed = seed_for(bound=2**16)
    monkeypatch.setattr(Arithmetic, "reward", _text_reward)
    runs, calls = _kept_runs(monkeypatch), _scoring_calls(monkeypatch)
    tables = {"folded": train(_cfg(policy, tmp_path / "folded", seed=seed, **kw))}
    assert all(m is runs[0].reference for m in calls), f"seed {seed}: a scoring pass ran beside the update"
    # The same run through the separate no-grad pass (the path of every ineligible step).
    monkeypatch.setattr(scoring, "scores_in_update", lambda run, gen_version, version: False)
    tables["score-pass"] = train(_cfg(policy, tmp_path / "score-pass", seed=seed, **kw))
    assert any(m is runs[1].weights.scorer for m in calls), f"seed {seed}: the forced run did not score"

    folded, scored = (t.pivot(index="step", columns="metric", values="value") for t in tables.values())
    assert list(folded.index) == [1, 2] and (folded["parity_tokens_differing"] == 0).all(), f"seed {seed}"
    assert (folded["time_score"] == 0).all() and (scored["time_score"] > 0).all(), f"seed {seed}"
    assert (folded["weight_delta_l2"] > 0).any(), f"seed {seed}: the weights did not move, the test proves nothing"
    kept = [c for c in scored.columns if not c.startswith(TIMES)]
    assert sorted(kept) == sorted(c for c in folded.columns if not c.startswith(TIMES)), f"seed {seed}"
    for m in kept:   # every metric of both runs (loss, parity, rewards, entropy, ...) to the bit
        assert same_bits(torch.tensor(folded[m].values), torch.tensor(scored[m].values)), f"seed {seed}: {m}"
    a, b = (r.weights for r in runs)
    assert same_bits(*({k: v.detach() for k, v in w.masters.items()} for w in (a, b))), f"seed {seed}: masters"
    assert same_bits(a.model.state_dict(), b.model.state_dict()), f"seed {seed}: the bf16 model differs"
    lp = [(tmp_path / name / "step1_logprobs.npz").read_bytes() for name in tables]
    assert lp[0] == lp[1], f"seed {seed}: step 1's log-probs file differs"


def test_eligibility_keeps_the_score_pass_where_the_bits_or_the_order_differ(policy, tmp_path):
    run = TrainerRank(_cfg(policy, tmp_path / "run"))
    assert scoring.scores_in_update(run, 0, 0)
    assert not scoring.scores_in_update(run, 0, 1), "a lagged generator"
    for kw in (dict(kernel_mode="standard"), dict(mini_batches=2), dict(epochs=2), dict(old_logprobs="sampler"),
               dict(kl_coef=0.1, kl_to="sampler", kl_in_reward=True), dict(correction="tis-token")):
        run.cfg = dataclasses.replace(run.cfg, **kw)
        assert not scoring.scores_in_update(run, 0, 0), kw
        run.cfg = _cfg(policy, tmp_path / "run")
    run.weights.sharded = torch.nn.Linear(1, 1)   # FSDP2: the sharded module trains, the whole model scores
    assert run.weights.scorer is not run.weights.module and not scoring.scores_in_update(run, 0, 0)


def test_a_parity_break_stops_the_folded_update_before_its_optimizer_step(policy, tmp_path, monkeypatch):
    """The generator's own copy (sync='copy') drifts from the trainer's weights, so its log-probs are not the
    trainer's: the folded step raises the score pass's ParityError, word for word, after the update's backward and
    before its optimizer step (the weights as they were, AdamW without state)."""
    seed = seed_for()
    messages, backwards = {}, []
    eligible, spec = scoring.scores_in_update, step_module.get_loss("grpo")

    def loss_fn(*args):   # each loss notes its backward
        loss, stats = spec.fn(*args)
        loss.register_hook(lambda grad: backwards.append(name))
        return loss, stats

    monkeypatch.setattr(step_module, "get_loss", lambda loss: dataclasses.replace(spec, fn=loss_fn))
    for name, folded in (("folded", True), ("score-pass", False)):
        monkeypatch.setattr(scoring, "scores_in_update", eligible if folded else lambda *args: False)
        run = TrainerRank(_cfg(policy, tmp_path / name, sync="copy", steps=1))
        assert eligible(run, 0, 0)
        norm = run.sync.generator.model.norm.weight
        with torch.no_grad():
            norm += 0.05 * torch.randn(norm.shape, generator=torch.Generator().manual_seed(seed)).to(norm.dtype)
        w = run.weights
        before = {k: v.detach().clone() for k, v in w.masters.items()}, \
            {k: v.clone() for k, v in w.model.state_dict().items()}
        with mode("invariant"), pytest.raises(ParityError) as e:
            train_step(run, 1)
        messages[name] = str(e.value)
        assert same_bits(({k: v.detach() for k, v in w.masters.items()}, w.model.state_dict()), before), \
            f"seed {seed}: {name}: the weights changed"
        assert not w.opt.state, f"seed {seed}: {name}: the optimizer stepped"
        assert (name in backwards) == folded, f"seed {seed}: {name}: the update's backward ran: {backwards}"
        value = run.log.close().set_index("metric")["value"]
        assert value["parity_tokens_differing"] > 0, f"seed {seed}: {name}: the break is on record"
    assert messages["folded"] == messages["score-pass"], f"seed {seed}"
    assert "\n" not in messages["folded"] and messages["folded"].startswith("step 1: generator and trainer log-probs")


def test_a_nan_loss_in_the_folded_update_stops_as_before(policy, tmp_path, monkeypatch):
    """A loss that is not finite at step 2: the step's parity check (in the update, after its backward) is on record,
    then the FloatingPointError of the separate pass's runs, before the optimizer step, step 1's checkpoint kept."""
    import pandas as pd

    from workbench.rl.checkpoint import latest_checkpoint

    spec, calls = step_module.get_loss("grpo"), []

    def nan_from_step_2(*args):
        calls.append(1)
        loss, stats = spec.fn(*args)
        return loss * (float("nan") if len(calls) >= 2 else 1.0), stats

    monkeypatch.setattr(step_module, "get_loss", lambda name: dataclasses.replace(spec, fn=nan_from_step_2))
    with pytest.raises(FloatingPointError, match=r"step 2: the loss is nan; the last good checkpoint \(step 1\)"):
        train(_cfg(policy, tmp_path, checkpoint_every=1))
    written = pd.read_csv(tmp_path / "metrics.csv")
    assert set(written[written.step == 2].metric) == {"parity_max_abs_diff", "parity_mean_abs_diff",
                                                      "parity_tokens_differing", "parity_tokens_checked",
                                                      "sampler_trainer_kl", "is_ess",
                                                      "seq_logratio_sd", "seq_ratio_outside_1.2"}
    assert written[(written.step == 2) & (written.metric == "parity_tokens_differing")].value.item() == 0
    assert '"step": 1' in (latest_checkpoint(tmp_path) / "state.json").read_text()

"""The counting task of the regime map: answers sized to the length budget, every step checked."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import seed_for
from workbench.tasks import make_task
from workbench.tasks.counting import ANSWER_SHARE, CountingChain, answer_tokens, terms_for


def _answer(problem, wrong_at=None, value=7, stop=None):
    start, step, n = (int(x) for x in problem.answer.split(":"))
    numbers = [start + k * step for k in range(n)][:stop]
    if wrong_at is not None:
        numbers[wrong_at] = value
    return ", ".join(map(str, numbers))


@pytest.mark.parametrize("length", [64, 256, 2048, 4096])
def test_a_right_answer_fills_three_quarters_of_the_budget(length):
    task = make_task("counting", seed=3, difficulty=2, max_new_tokens=length)
    n = task.terms
    assert answer_tokens(99, 19, n) <= ANSWER_SHARE * length < answer_tokens(99, 19, n + 1)
    for p in task.problems(5):
        assert task.scores(_answer(p), p) == {"steps": 1.0, "exact": 1.0, "reached": 1.0}


def test_terms_grow_with_the_length():
    assert terms_for(256) < terms_for(1024) < terms_for(2048) < terms_for(4096)


def test_partial_credit_per_step():
    seed = seed_for()
    task = CountingChain(seed=seed, max_new_tokens=512)
    p = task.problem(0)
    n = task.terms
    assert task.reward("", p) == 0.0
    # A slip costs its own step and the next one's check against it; the chain goes on.
    assert task.reward(_answer(p, wrong_at=5, value=-1), p) == pytest.approx((n - 2) / n), f"seed {seed}"
    # Stopping half way earns half; numbers past the n-th (a preamble's are not) change nothing.
    assert task.reward(_answer(p, stop=n // 2), p) == pytest.approx((n // 2) / n), f"seed {seed}"
    assert task.reward(_answer(p) + ", 1, 2, 3", p) == 1.0, f"seed {seed}"
    # A constant answer, or the same number repeated, earns at most the first step.
    start = int(p.answer.split(":")[0])
    assert task.reward(", ".join([str(start)] * n), p) == pytest.approx(1 / n), f"seed {seed}"


def test_problems_are_deterministic_and_eval_is_another_stream():
    a, b = CountingChain(seed=1, max_new_tokens=256), CountingChain(seed=1, max_new_tokens=256)
    assert a.problems(4, start=10) == b.problems(4, start=10)
    assert a.eval_problems(4) != a.problems(4)
    assert all(f"first {a.terms} numbers" in p.prompt for p in a.eval_problems(4))


def test_too_short_a_budget_is_refused():
    with pytest.raises(ValueError, match="at least 16 new tokens"):
        CountingChain(max_new_tokens=4)


def test_the_answer_text_is_what_the_reward_calls_right():
    task = CountingChain(seed=seed_for(), max_new_tokens=300)
    for p in task.problems(4):
        assert task.scores(task.answer_text(p), p) == {"steps": 1.0, "exact": 1.0, "reached": 1.0}


@pytest.mark.slow
def test_warm_start_fine_tunes_the_real_policy_toward_the_answers(smollm2, tmp_path):
    """Two supervised steps on the real SmolLM2-135M-Instruct (standard kernels, CPU): the answer tokens' loss
    falls on the batch it trained on, the start rate is measured before
    and after, and the saved checkpoint is the starting policy an RL run loads."""
    import torch

    from workbench.kernels import mode
    from workbench.models import load_pretrained, load_tokenizer
    from workbench.policies.warmstart import WarmStartConfig, _batch, warm_start

    cfg = WarmStartConfig(policy=smollm2, max_new_tokens=24, steps=2, batch_size=2, lr=3e-5, eval_every=2,
                          eval_problems=2, target_reward=(0.99, 1.0), device="cpu")
    table = warm_start(cfg, tmp_path / "ws")
    by = table.groupby("metric").step.apply(list).to_dict()
    assert by["loss"] == [1, 2] and by["sampled_reward"] == [0, 2]
    assert table[table.metric == "sampled_reward"].value.between(0, 1).all()
    task = make_task("counting", difficulty=2, max_new_tokens=24)
    tok = load_tokenizer(smollm2)
    ids, lens, mask = _batch(tok, task.problems(2, start=2), task, True, "cpu")   # step 1's batch

    def loss(path):   # both through bf16, as the warm start saves: the rounding is not the fine-tune's
        with torch.no_grad(), mode("standard"):
            logits = load_pretrained(path, dtype=torch.bfloat16).float()(ids, seq_lens=lens).float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        return float((nll.view(2, -1) * mask[:, :-1]).sum() / mask.sum())

    before, after = loss(smollm2), loss(tmp_path / "ws")
    print(f"answer loss on step 1's batch: {before:.4f} -> {after:.4f}")
    assert after < before, f"the fine-tune did not move the policy toward the answers: {before:.4f} -> {after:.4f}"
    with pytest.raises(ValueError, match="already holds a policy"):
        warm_start(cfg, tmp_path / "ws")
    with pytest.raises(ValueError, match="nothing to imitate"):
        warm_start(WarmStartConfig(policy=smollm2, task="arithmetic-chat", device="cpu"), tmp_path / "other")
    assert not (tmp_path / "other").exists(), "a refused warm start leaves no folder"
    # A policy already at the range's low end is saved as it is: more fine-tuning would only raise its rate.
    table = warm_start(dataclasses.replace(cfg, target_reward=(0.0, 1.0)), tmp_path / "as-is")
    assert "loss" not in set(table.metric) and table[table.metric == "in_range"].value.tolist() == [1.0]


def test_the_warm_start_runs_deterministic_algorithms_and_restores_the_setting(monkeypatch):
    import os

    import torch

    from workbench.policies.warmstart import deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    with deterministic():
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() == before

"""The counting task of the regime map: answers sized to the length budget, every step checked."""

from __future__ import annotations

import random

import pytest

from workbench.rl.chain import ANSWER_SHARE, CountingChain, answer_tokens, terms_for
from workbench.rl.tasks import make_task


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
    seed = random.randrange(2**31)
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

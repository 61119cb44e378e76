"""A task whose reward needs long outputs: counting up in steps, every step checked.

The prompt asks for the first n numbers of a + k*b (k = 0, 1, ...), comma-separated. The reward is the share of the
n steps that are right: the first number must be a, and each later one must be the number the completion wrote
before it plus b. Each step is checked against the completion's own previous number, so a slip costs one or two
steps, not the rest of the chain, and the partial credit stays informative at any length.

Why this task for the length axis of the ON/OFF regime map:
- The answer is long by construction: n is chosen so that a right answer fills about three quarters of
  `max_new_tokens` (`terms_for`), so a policy cannot shorten it without losing reward, as it does on one-number
  answers (the `long` preset's answers fell to ~9 tokens).
- It is multi-step arithmetic with carries, the skill GSM8K-style RL trains, at a level a 135M instruct model
  gets partly right (its start rate is measured and recorded with each run, not assumed).
- It is checked exactly, offline, with no parser ambiguity: the completion's integers in order.
"""

from __future__ import annotations

import random
import re

from .problem import Problem

ANSWER_SHARE = 0.75
"""The share of max_new_tokens a right answer takes: room for the model's own preamble and a final line."""

_NUMBER = re.compile(r"-?\d+")


def answer_tokens(start: int, step: int, n: int) -> int:
    """The tokens of the right answer '17, 30, 43, ...' for a digit-by-digit tokenizer (SmolLM2's, Qwen's):
    each number's digits, and ', ' between numbers (SmolLM2: ',' and ' ' are a token each)."""
    return sum(len(str(start + k * step)) + 2 for k in range(n))


def terms_for(max_new_tokens: int, start: int = 99, step: int = 19) -> int:
    """The most terms whose answer fits ANSWER_SHARE of max_new_tokens, for the largest start and step drawn."""
    n = 1
    while answer_tokens(start, step, n + 1) <= ANSWER_SHARE * max_new_tokens:
        n += 1
    return n


def _parse(problem: Problem) -> tuple[int, int, int]:
    start, step, n = (int(x) for x in problem.answer.split(":"))
    return start, step, n


class CountingChain:
    """Count up from a in steps of b, n numbers: a (10..99) and b drawn per problem from (seed, index), n from
    max_new_tokens (`terms_for`). difficulty d: b from 3 to 10 d - 1. `Problem.answer` holds 'a:b:n'."""

    name = "counting"

    def __init__(self, seed: int = 0, difficulty: int = 2, max_new_tokens: int = 256):
        if difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {difficulty}")
        self.seed, self.difficulty, self.max_new_tokens = seed, difficulty, max_new_tokens
        self.top = 10 * difficulty - 1
        self.terms = terms_for(max_new_tokens, 99, self.top)
        if self.terms < 2:
            raise ValueError(f"task 'counting': max_new_tokens={max_new_tokens} leaves room for fewer than 2 numbers; "
                             "give at least 16 new tokens")

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"counting:{self.seed}:{self.difficulty}:{index}")
        start, step = rng.randint(10, 99), rng.randint(3, self.top)
        prompt = (f"Count up from {start} in steps of {step}. Write the first {self.terms} numbers of the sequence, "
                  "separated by commas, and nothing else.")
        return Problem(prompt, f"{start}:{step}:{self.terms}")

    def problems(self, n: int, start: int = 0) -> list[Problem]:
        return [self.problem(i) for i in range(start, start + n)]

    def eval_problems(self, n: int) -> list[Problem]:
        """Problems of another seed: other starts and steps."""
        return CountingChain(self.seed + 10_000, self.difficulty, self.max_new_tokens).problems(n)

    @staticmethod
    def answer_text(problem: Problem) -> str:
        """The right answer, as the prompt asks for it: the n numbers, separated by commas."""
        start, step, n = _parse(problem)
        return ", ".join(str(start + k * step) for k in range(n))

    @staticmethod
    def steps_right(completion: str, problem: Problem) -> list[bool]:
        """For each of the n steps: whether it is right (the first number is a; each later one is the completion's
        previous number plus b). Numbers past the n-th are ignored; missing ones are wrong."""
        start, step, n = _parse(problem)
        numbers = [int(x) for x in _NUMBER.findall(completion)[:n]]
        right = [bool(numbers) and numbers[0] == start]
        right += [numbers[k] == numbers[k - 1] + step for k in range(1, len(numbers))]
        return right + [False] * (n - len(numbers))

    def reward(self, completion: str, problem: Problem) -> float:
        """The share of the n steps that are right."""
        right = self.steps_right(completion, problem)
        return sum(right) / len(right)

    def scores(self, completion: str, problem: Problem) -> dict[str, float]:
        """steps: the reward; exact: every step right; reached: the completion wrote all n numbers."""
        right = self.steps_right(completion, problem)
        _, _, n = _parse(problem)
        return {"steps": sum(right) / len(right), "exact": float(all(right)),
                "reached": float(len(_NUMBER.findall(completion)) >= n)}

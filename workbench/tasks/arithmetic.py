"""Synthetic arithmetic generated from a seed (the offline default), in two styles: bare `7*8=` for the
self-trained policy, and a question with GSM8K's reasoning instruction for chat models."""

from __future__ import annotations

import random
import re

from .answers import normalize_number
from .gsm8k import PROMPT_TEMPLATE, FinalAnswer
from .problem import Problem


class Arithmetic:
    """Synthetic arithmetic: 'a op b op c ...' with integer answers, generated from (seed, index).

    difficulty d: d + 1 operands of up to d digits, operators + - * (usual precedence).
    """

    name = "arithmetic"

    def __init__(self, seed: int = 0, difficulty: int = 1):
        if difficulty < 1:
            raise ValueError(f"difficulty must be >= 1, got {difficulty}")
        self.seed, self.difficulty = seed, difficulty

    def problem(self, index: int) -> Problem:
        rng = random.Random(f"{self.seed}:{self.difficulty}:{index}")
        hi = 10**self.difficulty - 1
        terms = [str(rng.randint(0, hi))]
        for _ in range(self.difficulty):
            terms += [rng.choice("+-*"), str(rng.randint(0, hi))]
        expr = "".join(terms)
        return Problem(f"{expr}=", str(_evaluate(terms)))

    def problems(self, n: int, start: int = 0) -> list[Problem]:
        return [self.problem(i) for i in range(start, start + n)]

    def eval_problems(self, n: int) -> list[Problem]:
        """Problems of another seed (at difficulty 1 there are only 300 distinct problems, so these overlap
        the training stream; from difficulty 2 on they are practically unseen)."""
        return Arithmetic(seed=self.seed + 10_000, difficulty=self.difficulty).problems(n)

    def reward(self, completion: str, problem: Problem) -> float:
        """Exact match: the completion's leading number (after spaces) equals the answer."""
        m = re.match(r"\s*(-?\d+)", completion)
        return float(m is not None and normalize_number(m.group(1)) == problem.answer)

    def scores(self, completion: str, problem: Problem) -> dict[str, float]:
        return {"exact": self.reward(completion, problem)}


class ArithmeticChat(FinalAnswer, Arithmetic):
    """The same problems as `Arithmetic`, asked as a question with GSM8K's reasoning instruction
    ("What is 7 * 8?" + PROMPT_TEMPLATE's last line) for a chat model, scored on its final answer like GSM8K
    (lenient: the number after '####', else the last number; strict: after '####' only).

    At difficulty 1 (single digits, + - *) SmolLM2-135M-Instruct answers 23% correctly sampled at T=1 and 42%
    greedy (48 problems, 160 new tokens, chat template; docs/results/2026-11-23_task-selection): room to learn
    both ways, which GSM8K (2-3%) and two-digit addition (4-6%) do not leave it.
    """

    name = "arithmetic-chat"

    def problem(self, index: int) -> Problem:
        bare = super().problem(index)
        expr = re.sub(r"(?<=\d)([-+*])", r" \1 ", bare.prompt[:-1])  # '7*8=' -> '7 * 8'
        return Problem(f"What is {expr}?\n" + PROMPT_TEMPLATE.splitlines()[1] + "\n", bare.answer)


def _evaluate(terms: list[str]) -> int:
    """+ - * over integers with * first, left to right (no eval)."""
    values, ops = [int(terms[0])], []
    for op, num in zip(terms[1::2], terms[2::2]):
        if op == "*":
            values[-1] *= int(num)
        else:
            ops.append(op)
            values.append(int(num))
    total = values[0]
    for op, v in zip(ops, values[1:]):
        total = total + v if op == "+" else total - v
    return total

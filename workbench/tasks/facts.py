"""The vLLM + TorchTitan blog post's five factual prompts, with its reward."""

from __future__ import annotations

from .problem import Problem

FACTS = (("The capital of France is", "paris"), ("What is 7 times 8?", "56"),
         ("The first president of the United States was", "washington"),
         ("The chemical symbol for water is", "h2o"), ("The largest planet in our solar system is", "jupiter"))
"""The five prompts and expected answers of torchtitan's `deterministic_vllm_rl/simple_rl.py`, verbatim."""


class Facts:
    """The vLLM + TorchTitan blog post's task (`simple_rl.py`): the same five factual prompts every step,
    rewarded by its `trivial_reward_function`, transcribed rule for rule:

    - an empty completion: 0;
    - otherwise 1.0, x 0.1 if more than 10% of its characters are non-ASCII,
      x (1 - 0.9 x its share of uppercase characters),
      x 2 if the expected answer appears in it (case-insensitively), else x 0.5.

    So the reward mixes style (lowercase, ASCII) and content; `scores` reports the content alone."""

    name = "facts"

    def __init__(self, seed: int = 0):
        self.items = [Problem(p, a) for p, a in FACTS]

    def problems(self, n: int, start: int = 0) -> list[Problem]:
        """Problems `start`, ..., wrapping around the five: a step of 5 prompts asks each once, in order."""
        return [self.items[i % len(self.items)] for i in range(start, start + n)]

    def eval_problems(self, n: int) -> list[Problem]:
        return self.problems(n)

    def reward(self, completion: str, problem: Problem) -> float:
        if not completion:
            return 0.0
        reward = 1.0
        if sum(ord(c) > 127 for c in completion) / len(completion) > 0.1:
            reward *= 0.1
        reward *= 1.0 - 0.9 * sum(c.isupper() for c in completion) / len(completion)
        return reward * (2.0 if problem.answer.lower() in completion.lower() else 0.5)

    def scores(self, completion: str, problem: Problem) -> dict[str, float]:
        return {"answer": float(problem.answer.lower() in completion.lower())}

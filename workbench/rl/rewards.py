"""The step's reward stage: the task's rewards and scores of its completions, where one completion's failure costs
that completion, not the run."""

from __future__ import annotations

import torch

from .rollout import RolloutBatch
from .samplers import Rollout


class RewardStage:
    """The task's rewards and scores of a step's completions. A completion whose reward or scores raise (a task's
    bug, a sandbox's failure) gets reward 0 and scores 0, is counted (metric `reward_failures`), and the run goes
    on: one bad completion should not cost a run. The first failure prints one line."""

    def __init__(self, task, tok, group_size: int):
        self.task, self.tok, self.group_size = task, tok, group_size
        self.warned = False

    def __call__(self, step: int, rollout: Rollout, batch: RolloutBatch) -> tuple[torch.Tensor, list[tuple]]:
        """([B] rewards on the batch's device, per completion (scores, length, truncated, failed))."""
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in batch.completions]
        group = [rollout.problems[i // self.group_size] for i in range(len(texts))]
        rewards = self._rewards(step, texts, group)
        scores = [None if r is None else self._guarded(step, i, self.task.scores, t, p)
                  for i, (r, t, p) in enumerate(zip(rewards, texts, group))]
        per_sequence = [(s or {}, len(c), g.finish_reason == "length", s is None)
                        for s, c, g in zip(scores, batch.completions, rollout.completions)]
        return torch.tensor([0.0 if r is None else r for r in rewards], device=batch.device), per_sequence

    def _rewards(self, step: int, texts: list[str], group: list) -> list[float | None]:
        """Each completion's reward, None where it raised."""
        batch_rewards = getattr(self.task, "rewards", None)   # the code task checks a batch in parallel
        if batch_rewards is not None:
            try:
                return list(batch_rewards(texts, group))
            except Exception:   # one completion's failure: each is rewarded alone, to find it
                pass
        return [self._guarded(step, i, self.task.reward, t, p) for i, (t, p) in enumerate(zip(texts, group))]

    def _guarded(self, step: int, i: int, fn, text: str, problem):
        """fn(text, problem), or None where it raises (the first time with a warning)."""
        try:
            return fn(text, problem)
        except Exception as e:
            if not self.warned:
                self.warned = True
                first = (str(e).splitlines() or [""])[0]
                print(f"warning: step {step}: the reward of completion {i} raised {type(e).__name__}: {first}; it "
                      "counts 0 and the run goes on (metric reward_failures counts them; warned once)")
            return None

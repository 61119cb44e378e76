"""`Problem`: one prompt of a task and its reference answer, the unit every task hands the trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """The reference answer: a normalised number (see `answers.normalize_number`), or a word (`Facts`), or the
    task's own encoding of what a right answer is (`counting.CountingChain`: 'start:step:n')."""

"""The tasks by name: `make_task` builds one from the run's settings, `TASKS` lists the names."""

from __future__ import annotations

from .arithmetic import Arithmetic, ArithmeticChat
from .counting import CountingChain
from .facts import Facts
from .gsm8k import GSM8K, default_gsm8k

TASKS = ("arithmetic", "arithmetic-chat", "counting", "gsm8k", "facts", "humaneval", "humaneval-partial")


def make_task(name: str, seed: int = 0, difficulty: int = 1, source: str = "", question_field: str = "question",
              answer_field: str = "answer", max_new_tokens: int = 256):
    """A task by name: 'arithmetic', 'arithmetic-chat' and 'facts' (need nothing), 'counting' (a chain of n numbers
    sized to `max_new_tokens`, `counting.CountingChain`), 'gsm8k' (needs `source`: a
    folder holding train.jsonl/test.jsonl or .parquet, one such file, or a hub id; `question_field`/`answer_field`
    name its columns), or 'humaneval' / 'humaneval-partial' (code run in a sandbox, rewarded for passing every
    test / the share of tests passed; `source`: another HumanEval-format file, default the packaged one)."""
    if name == "arithmetic":
        return Arithmetic(seed=seed, difficulty=difficulty)
    if name == "arithmetic-chat":
        return ArithmeticChat(seed=seed, difficulty=difficulty)
    if name == "facts":
        return Facts(seed)
    if name == "counting":
        return CountingChain(seed, difficulty, max_new_tokens)
    if name == "gsm8k":
        source = source or str(default_gsm8k() or "")
        if not source:
            raise ValueError("task 'gsm8k' needs a source: a folder holding train.jsonl/test.jsonl, a file, "
                             "or a hub id such as openai/gsm8k (no offline copy: set WORKBENCH_GSM8K)")
        return GSM8K(source, "train", seed=seed, question_field=question_field, answer_field=answer_field)
    if name in ("humaneval", "humaneval-partial"):
        from .humaneval import HumanEval  # here: the sandbox is needed by this task only

        return HumanEval(source or None, seed=seed, reward="partial" if name.endswith("partial") else "binary")
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")

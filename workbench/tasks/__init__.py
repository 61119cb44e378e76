"""Tasks: prompts, a reference answer, and a reward. Each has the same small interface: `problems(n, start)` (the
training stream, deterministic in the seed), `eval_problems(n)` (a held-out split), `reward(completion, problem)`
(the RL reward) and `scores(completion, problem)` (every way of scoring it, reported side by side).

- `arithmetic.py`: synthetic arithmetic from a seed (the offline default), bare or asked as a question;
- `gsm8k.py`: GSM8K, or any question/answer data, from local JSONL or parquet files (or a hub id);
- `facts.py`: the vLLM + TorchTitan blog post's five factual prompts with its reward;
- `counting.py`: counting up in steps, a reward that needs long outputs;
- `humaneval.py`: HumanEval, code rewarded by running it in the sandbox (imported only when asked for);
- `answers.py`: is a completion's answer the reference answer (strict, lenient); `problem.py`: the unit;
- `registry.py`: `make_task`, a task by name.
"""

from .answers import extract_answer, lenient_correct, normalize_number
from .arithmetic import Arithmetic, ArithmeticChat
from .counting import CountingChain
from .facts import Facts
from .gsm8k import GSM8K, PROMPT_TEMPLATE, default_gsm8k
from .problem import Problem
from .registry import TASKS, make_task

__all__ = [
    "GSM8K",
    "PROMPT_TEMPLATE",
    "TASKS",
    "Arithmetic",
    "ArithmeticChat",
    "CountingChain",
    "Facts",
    "Problem",
    "default_gsm8k",
    "extract_answer",
    "lenient_correct",
    "make_task",
    "normalize_number",
]

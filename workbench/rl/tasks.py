"""Tasks: prompts, a reference answer, and a reward. GSM8K from a local JSONL (or a hub id where
there is a network), and a synthetic arithmetic task generated from a seed (the offline default).

Every task has the same small interface: `problems(n, start)` (the training stream, deterministic
in the seed), `eval_problems(n)` (a held-out split), `reward(completion, problem)` (the RL reward)
and `scores(completion, problem)` (every way of scoring it, reported side by side).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

_NUMBER = r"-?\$?\s*-?\d[\d,]*(?:\.\d+)?"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    """The reference answer, a normalised number (see `normalize_number`)."""


def normalize_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5', '-7' -> '-7', '42.0' -> '42'; None if it is no number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    out = format(value.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def extract_answer(text: str, mode: str = "lenient") -> str | None:
    """The final answer of a model's output, normalised, or None.

    strict: only GSM8K's '#### <number>' (the last one). lenient: that, else the last
    '\\boxed{<number>}', else the last 'answer is <number>', else the last number in the text.
    """
    if mode not in ("strict", "lenient"):
        raise ValueError(f"extraction mode must be 'strict' or 'lenient', got {mode!r}")
    patterns = [rf"####\s*({_NUMBER})"]
    if mode == "lenient":
        patterns += [rf"\\boxed\{{\s*({_NUMBER})\s*\}}", rf"answer is\s*:?\s*({_NUMBER})", rf"({_NUMBER})"]
    for pattern in patterns:
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return normalize_number(found[-1])
    return None


PROMPT_TEMPLATE = "Question: {question}\nAnswer step by step, then give the final number after '####'.\n"


class GSM8K:
    """GSM8K (MIT licence): problems from `{split}.jsonl` in a local folder (or a file), or a hub id.

    The training stream walks the split in an order shuffled by the seed, wrapping around; the
    evaluation split is `test` (read lazily, from the same folder or hub id).
    """

    name = "gsm8k"

    def __init__(self, source: str | Path, split: str = "train", seed: int = 0):
        self.source, self.split, self.seed = source, split, seed
        rows = self._read(source, split)
        self.items = [Problem(PROMPT_TEMPLATE.format(question=r["question"]), self._reference(r, i))
                      for i, r in enumerate(rows)]
        if not self.items:
            raise ValueError(f"GSM8K: the {split} split at {source} has no problems")
        self._order = list(range(len(self.items)))
        random.Random(seed).shuffle(self._order)

    def __len__(self) -> int:
        return len(self.items)

    def problems(self, n: int, start: int = 0) -> list[Problem]:
        return [self.items[self._order[i % len(self.items)]] for i in range(start, start + n)]

    def eval_problems(self, n: int) -> list[Problem]:
        """The first n problems of the test split (from the same folder or hub id)."""
        if Path(self.source).is_file():
            raise ValueError(f"GSM8K: evaluation reads the test split, which needs a folder holding test.jsonl "
                             f"(or a hub id), not the file {self.source}")
        return GSM8K(self.source, "test").items[:n]

    @staticmethod
    def _read(source, split: str) -> list[dict]:
        path = Path(source)
        if path.is_dir():
            path = path / f"{split}.jsonl"
        if path.exists():
            rows = []
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
            return rows
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)):
            try:
                from datasets import load_dataset

                return list(load_dataset(str(source), "main", split=split))
            except Exception as e:  # no datasets package, offline, unknown id
                raise ValueError(f"GSM8K: {source!r} is no local file or folder, and loading it from the hub "
                                 f"failed ({type(e).__name__}: {e}); pass the folder holding {split}.jsonl") from None
        raise ValueError(f"GSM8K: no file {path}; pass a folder holding {split}.jsonl or the file itself")

    @staticmethod
    def _reference(row: dict, i: int) -> str:
        if "question" not in row or "answer" not in row:
            raise ValueError(f"GSM8K row {i} lacks 'question' or 'answer': {sorted(row)}")
        ref = extract_answer(row["answer"], "strict")
        if ref is None:
            raise ValueError(f"GSM8K row {i}: no '#### <number>' in its answer")
        return ref

    def reward(self, completion: str, problem: Problem, mode: str = "lenient") -> float:
        return float(extract_answer(completion, mode) == problem.answer)

    def scores(self, completion: str, problem: Problem) -> dict[str, float]:
        return {m: self.reward(completion, problem, m) for m in ("strict", "lenient")}


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


TASKS = ("arithmetic", "gsm8k")


def make_task(name: str, seed: int = 0, difficulty: int = 1, source: str = ""):
    """A task by name: 'arithmetic' (needs nothing) or 'gsm8k' (needs `source`)."""
    if name == "arithmetic":
        return Arithmetic(seed=seed, difficulty=difficulty)
    if name == "gsm8k":
        if not source:
            raise ValueError("task 'gsm8k' needs a source: a folder holding train.jsonl/test.jsonl, a file, "
                             "or a hub id such as openai/gsm8k")
        return GSM8K(source, "train", seed=seed)
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")


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

"""Tasks: prompts, a reference answer, and a reward. GSM8K (or any question/answer data) from local JSONL or
parquet files through Hugging Face `datasets` (or a hub id where there is a network), a synthetic arithmetic
task generated from a seed (the offline default) in two styles (bare `7*8=` for the self-trained policy, a
question with a reasoning instruction for chat models), and the vLLM + TorchTitan blog post's five factual
prompts with its reward.

Every task has the same small interface: `problems(n, start)` (the training stream, deterministic
in the seed), `eval_problems(n)` (a held-out split), `reward(completion, problem)` (the RL reward)
and `scores(completion, problem)` (every way of scoring it, reported side by side).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from pathlib import Path

from .answers import extract_answer, lenient_correct, normalize_number
from .chain import CountingChain
from .problem import Problem


PROMPT_TEMPLATE = "Question: {question}\nAnswer step by step, then give the final number after '####'.\n"

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> the `datasets` builder that reads it (any other suffix is read as JSON lines)."""


class FinalAnswer:
    """Scoring of a reasoned answer (GSM8K's, and arithmetic asked as a question): the completion's final number."""

    def reward(self, completion: str, problem: Problem, mode: str = "lenient") -> float:
        """The RL reward: the lenient score (`lenient_correct`); mode='strict' gives the strict one."""
        if mode == "lenient":
            return float(lenient_correct(completion, problem.answer))
        return float(extract_answer(completion, mode) == problem.answer)

    def scores(self, completion: str, problem: Problem) -> dict[str, float]:
        """strict: the last '#### <number>' equals the answer. lenient: `lenient_correct` (the reward)."""
        return {m: self.reward(completion, problem, m) for m in ("strict", "lenient")}


class GSM8K(FinalAnswer):
    """GSM8K (MIT licence), or any question/answer data: the `split` of a local folder (`{split}.jsonl`,
    `.json` or `.parquet`), one such file, or a hub id (`load_dataset(id, "main")`, where there is a network).

    Files are read through Hugging Face `datasets`, in memory (its cache goes to a temporary folder, removed
    after). `question_field` and `answer_field` name the columns; a missing one is an error naming the file
    and the fields it has. The reference answer is the number after '####' in the answer field or, where
    there is no '####', the whole field when it is a number (72, "1,234"); anything else is an error.

    The training stream walks the split in an order shuffled by the seed, wrapping around; the
    evaluation split is `test` (read lazily, from the same folder or hub id).
    """

    name = "gsm8k"

    def __init__(self, source: str | Path, split: str = "train", seed: int = 0, question_field: str = "question",
                 answer_field: str = "answer"):
        self.source, self.split, self.seed = source, split, seed
        self.question_field, self.answer_field = question_field, answer_field
        data, where = self._read(source, split)
        if len(data) == 0:
            raise ValueError(f"GSM8K: the {split} split at {source} has no problems")
        present = list(data.column_names)
        for role, field in (("question_field", question_field), ("answer_field", answer_field)):
            if field not in present:
                raise ValueError(f"GSM8K: {where} has no field {field!r} ({role}); its fields: "
                                 f"{', '.join(present) or 'none'}")
        columns = data.select_columns(list(dict.fromkeys((question_field, answer_field)))).to_dict()
        questions, answers = columns[question_field], columns[answer_field]
        self.items = [Problem(PROMPT_TEMPLATE.format(question=self._question(q, i, where, question_field)),
                              self._reference(a, i, where, answer_field))
                      for i, (q, a) in enumerate(zip(questions, answers))]
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
                             f"(or test.parquet, or a hub id), not the file {self.source}")
        return GSM8K(self.source, "test", question_field=self.question_field,
                     answer_field=self.answer_field).items[:n]

    @staticmethod
    def _read(source, split: str):
        """(a `datasets.Dataset`, where it came from for messages)."""
        path = Path(source)
        if path.is_dir():
            found = [path / f"{split}{suffix}" for suffix in _BUILDERS if (path / f"{split}{suffix}").is_file()]
            if not found:
                raise ValueError(f"GSM8K: no file {path / split}.jsonl (nor .json, .parquet); pass a folder holding "
                                 f"{split}.jsonl or the file itself")
            path = found[0]
        if path.is_file():
            return _load_file(path), str(path)
        if path.suffix.lower() not in _BUILDERS and re.fullmatch(r"[\w.-]+/[\w.-]+", str(source)):
            try:
                from datasets import load_dataset

                return load_dataset(str(source), "main", split=split), f"{source} ({split})"
            except Exception as e:  # no datasets package, offline, unknown id
                reason = (str(e).strip().splitlines() or [""])[0]
                raise ValueError(f"GSM8K: {source!r} is no local file or folder, and loading it from the hub "
                                 f"failed ({type(e).__name__}: {reason}); pass the folder holding {split}.jsonl"
                                 ) from None
        raise ValueError(f"GSM8K: no file {path}; pass a folder holding {split}.jsonl or the file itself")

    @staticmethod
    def _question(value, i: int, where: str, field: str) -> str:
        if value is None:
            raise ValueError(f"GSM8K: {where} row {i} has no {field!r}")
        return str(value)

    @staticmethod
    def _reference(value, i: int, where: str, field: str) -> str:
        if value is None:
            raise ValueError(f"GSM8K: {where} row {i} has no {field!r}")
        text = str(value)
        ref = extract_answer(text, "strict") if "####" in text else normalize_number(text.strip())
        if ref is None:
            raise ValueError(f"GSM8K: {where} row {i}: no '#### <number>' in its {field!r}, nor is it a number: "
                             f"{text[:80]!r}")
        return ref


def _load_file(path: Path):
    """One JSON(L) or parquet file as a `datasets.Dataset`, in memory, offline, without a lasting cache."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError("reading task files needs Hugging Face datasets: pip install datasets") from e
    builder = _BUILDERS.get(path.suffix.lower(), "json")
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # "Generating train split: 7473 examples" for a local file is noise
    try:
        with tempfile.TemporaryDirectory(prefix="workbench-datasets-") as cache:
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                         keep_in_memory=True)
    except StopIteration:  # what `datasets` raises for an empty JSON file
        return datasets.Dataset.from_dict({})
    except Exception as e:  # pyarrow and datasets raise many kinds for a file they cannot read
        if builder == "json":
            _first_bad_json_line(path)
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise ValueError(f"GSM8K: {path}: `datasets` could not read it as {builder} ({type(cause).__name__}: "
                         f"{reason})") from None
    finally:
        if bars:
            datasets.enable_progress_bars()


def _first_bad_json_line(path: Path) -> None:
    """Name the first line of a JSON-lines file that is no JSON (datasets says only that parsing failed)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None


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


TASKS = ("arithmetic", "arithmetic-chat", "counting", "gsm8k", "facts", "humaneval", "humaneval-partial")


def default_gsm8k() -> Path | None:
    """The offline GSM8K copy: $WORKBENCH_GSM8K, else `shared/data/gsm8k` beside this checkout, if it exists."""
    env = os.environ.get("WORKBENCH_GSM8K")
    folder = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
    return folder if (folder / "train.jsonl").exists() else None


def make_task(name: str, seed: int = 0, difficulty: int = 1, source: str = "", question_field: str = "question",
              answer_field: str = "answer", max_new_tokens: int = 256):
    """A task by name: 'arithmetic', 'arithmetic-chat' and 'facts' (need nothing), 'counting' (a chain of n numbers
    sized to `max_new_tokens`, `chain.CountingChain`), 'gsm8k' (needs `source`: a
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
        from ..sandbox.humaneval import HumanEval  # here: the sandbox is needed by this task only

        return HumanEval(source or None, seed=seed, reward="partial" if name.endswith("partial") else "binary")
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

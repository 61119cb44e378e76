"""GSM8K (or any question/answer data) as a task: read from local JSONL or parquet files through Hugging Face
`datasets` (or a hub id where there is a network), scored on the completion's final number (`FinalAnswer`, which
arithmetic asked as a question shares).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
from pathlib import Path

from .answers import extract_answer, lenient_correct, normalize_number
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


def default_gsm8k() -> Path | None:
    """The offline GSM8K copy: $WORKBENCH_GSM8K, else `shared/data/gsm8k` beside this checkout, if it exists."""
    env = os.environ.get("WORKBENCH_GSM8K")
    folder = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k"
    return folder if (folder / "train.jsonl").exists() else None

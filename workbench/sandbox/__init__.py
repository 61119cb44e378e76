"""Running untrusted Python, and the code tasks rewarded by it: `Sandbox` runs one program in a child process
under limits (sandbox.py; how the child is isolated: launch.py, what it does first: child.py; its seccomp
filter: syscalls.py; its slot's cgroup: cgroup.py), `SandboxPool` runs many in parallel as futures (pool.py),
`checks` scores a solution against a HumanEval-style test, unit by unit, judged outside the solution's
interpreter (the programs it runs: harness.py, judge.py; the values read back with bounded work: values.py,
reading.py), `extract` finds the code in a completion, and `HumanEval` is the task (humaneval.py). The threat
model: docs/sandbox.md.
"""

from .checks import CheckResult, Test, instrument_test, prepare_test, run_check
from .extract import extract_code, solution_program
from .humaneval import CodeProblem, HumanEval, read_problems
from .launch import Isolation
from .pool import SandboxPool
from .sandbox import Limits, RunResult, Sandbox

__all__ = [
    "CheckResult",
    "CodeProblem",
    "HumanEval",
    "Isolation",
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxPool",
    "Test",
    "extract_code",
    "instrument_test",
    "prepare_test",
    "read_problems",
    "run_check",
    "solution_program",
]

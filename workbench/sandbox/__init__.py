"""Running untrusted Python: `Sandbox` runs one program in a child process under limits (sandbox.py; how the
child is isolated: launch.py, what it does first: child.py; its seccomp filter: syscalls.py; its slot's cgroup:
cgroup.py), `SandboxPool` runs many in parallel as futures (pool.py), `checks` scores a solution against a
HumanEval-style test, unit by unit, judged outside the solution's interpreter (the programs it runs: harness.py,
judge.py; the values read back with bounded work: values.py, reading.py), and `extract` finds the code in a
completion. The code task it rewards is `workbench/tasks/humaneval.py`. The threat model: docs/sandbox.md.
"""

from .checks import CheckResult, Test, instrument_test, prepare_test, run_check
from .extract import extract_code, solution_program
from .launch import Isolation
from .pool import SandboxPool
from .sandbox import Limits, RunResult, Sandbox

__all__ = [
    "CheckResult",
    "Isolation",
    "Limits",
    "RunResult",
    "Sandbox",
    "SandboxPool",
    "Test",
    "extract_code",
    "instrument_test",
    "prepare_test",
    "run_check",
    "solution_program",
]

"""Run a solution against a HumanEval-style test (`def check(candidate): assert ...`) in a sandbox, scoring each
assertion separately, so a reward can be all-or-nothing or partial.

The rule (`instrument_test`): a *unit* is a top-level statement of `check`'s body that holds an `assert` whose
condition is not a constant (`assert True, "..."`, in 36 HumanEval tests, checks nothing). Each unit runs in its
own `try`: it passes when it raises nothing (a `for` loop of asserts is one unit: all its iterations must pass);
a failing unit does not stop the next. Other statements (imports, set-up) run unguarded, as written; if one
raises, `check` stops there and the units after it count as failed.

binary: 1.0 when `check` ran to its end with every unit passing, i.e. exactly when HumanEval's own
`check(candidate)` passes. partial: the share of units that passed. A run that times out, crashes, exits, or
prints past the output cap scores 0 in both.
"""

from __future__ import annotations

import ast
import functools
import marshal
import secrets
from dataclasses import dataclass
from pathlib import Path

from .sandbox import Sandbox

UNIT_HOOK = "_wb_unit"
"""The keyword-only argument the instrumented `check` reports each unit to (harness.py passes it)."""
KINDS = ("binary", "partial")


@dataclass(frozen=True)
class CheckResult:
    passed: int
    """Units that passed."""
    total: int
    """Units in the test."""
    finished: bool
    """`check` ran to its end (no timeout, crash, exit, or exception outside a unit)."""
    error: str = ""
    """Why not everything passed (the first failing unit, or what stopped the run); '' when all did."""

    def score(self, kind: str) -> float:
        if kind == "binary":
            return float(self.finished and self.passed == self.total)
        if kind == "partial":
            return self.passed / self.total
        raise ValueError(f"unknown reward kind {kind!r}; choose one of {', '.join(KINDS)}")

    def scores(self) -> dict[str, float]:
        return {kind: self.score(kind) for kind in KINDS}


def instrument_test(test: str) -> tuple[str, int]:
    """(the test with each unit of `check` wrapped to report to `_wb_unit`, the number of units)."""
    tree = ast.parse(test)
    checks = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1:
        raise ValueError(f"a test needs exactly one top-level `def check(candidate)`; this one has {len(checks)}")
    check, units, body = checks[0], 0, []
    for statement in check.body:
        if any(isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)
               for node in ast.walk(statement)):
            body.append(_guarded(statement, units))
            units += 1
        else:
            body.append(statement)
    if units == 0:
        raise ValueError("the test's `check` asserts nothing (no `assert` on a non-constant condition)")
    check.body = body
    check.args.kwonlyargs.append(ast.arg(UNIT_HOOK))
    check.args.kw_defaults.append(None)
    return ast.unparse(ast.fix_missing_locations(tree)), units


def _guarded(statement: ast.stmt, unit: int) -> ast.Try:
    wrapper = ast.parse(f"try:\n    pass\nexcept Exception as _wb_error:\n    {UNIT_HOOK}({unit}, _wb_error)\n"
                        f"else:\n    {UNIT_HOOK}({unit}, None)\n").body[0]
    wrapper.body = [statement]
    return wrapper


def run_check(sandbox: Sandbox, solution: str, test: str, entry_point: str, units: int) -> CheckResult:
    """Run `solution` (a whole program) against `test` (instrumented, with `units` units) in `sandbox`."""
    nonce = secrets.token_hex(16)
    job = marshal.dumps({"nonce": nonce, "solution": solution, "test": test, "entry_point": entry_point})
    result = sandbox.run(_harness(), job)
    if result.timed_out:
        return CheckResult(0, units, False, f"timed out after {sandbox.limits.timeout_s:g} s")
    if result.output_capped:
        return CheckResult(0, units, False, f"printed more than {sandbox.limits.output_bytes} bytes")
    for line in reversed(result.stdout.decode(errors="replace").splitlines()):
        if line.startswith(nonce + " "):
            _, finished, passed, error = (line + " ").split(" ", 3)
            done = {int(u) for u in passed.split(",") if u.isdigit()} & set(range(units))
            return CheckResult(len(done), units, finished == "1", error.strip())
    tail = " ".join(result.stderr.decode(errors="replace").split()[-30:])
    return CheckResult(0, units, False, f"no result (exit status {result.returncode}): {tail}")


@functools.cache
def _harness() -> str:
    return Path(__file__).with_name("harness.py").read_text()

"""Score a solution against a HumanEval-style test (`def check(candidate): assert ...`), unit by unit, so a reward
can be all-or-nothing or partial; the verdict is reached outside the solution's interpreter.

A unit is a top-level statement of `check` holding an `assert` on a non-constant condition. `prepare_test` runs a
test as *calls* (the solution's process gets only the arguments and sends back plain values, compared here with the
expected values it never sees) or through the *judge* (a second sandboxed interpreter runs the test's code, its
`candidate` forwarding each call). binary: 1.0 when every unit passed and the run reached its end; partial: the share
of units passed; a timeout, crash or output past the cap scores 0. Nothing the solution's code can reach is read for
the verdict, only the values. The rules in full: docs/sandbox.md, "`workbench/sandbox/checks.py`: units, calls or
judge, binary or partial".
"""

from __future__ import annotations

import ast
import functools
import marshal
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from . import reading
from .sandbox import RunResult, Sandbox

UNIT_HOOK = "_wb_unit"
"""The keyword-only argument the instrumented `check` reports each unit to (judge.py passes it)."""
KINDS = ("binary", "partial")
_LITERAL_NODES = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp, ast.operator,
                  ast.unaryop, ast.Load)
_SINGLETONS = (True, False, None)


@dataclass(frozen=True)
class CheckResult:
    passed: int
    """Units that passed."""
    total: int
    """Units in the test."""
    finished: bool
    """The run reached its end (no timeout, CPU limit, crash, exit, or exception outside a unit)."""
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


@dataclass(frozen=True)
class Test:
    """A test made ready to run (`prepare_test`); hashable, so a problem holding it keys the pool's cache."""

    source: str
    """The test with each unit of `check` wrapped to report to `_wb_unit` (what judge.py runs)."""
    units: int
    """Scored units."""
    calls: bytes = b""
    """The units as (args, kwargs, operator, expected) tuples, marshalled; b'' when the test needs the judge."""
    prelude: str = ""
    """Code the judge runs before the test: the problem's prompt, whose helpers some tests call (HumanEval/32's
    `poly`). The entry point's name is then bound to the stand-in, as HumanEval's concatenation binds it to the
    solution's function."""


def prepare_test(test: str, prelude: str = "") -> Test:
    """The test instrumented, and its units as plain calls where every unit has that form (module doc)."""
    source, units = instrument_test(test)
    return Test(source, units, _plain_calls(test), prelude)


def instrument_test(test: str) -> tuple[str, int]:
    """(the test with each unit of `check` wrapped to report to `_wb_unit`, the number of units)."""
    tree = ast.parse(test)
    check = _check_of(tree)
    units, body = 0, []
    for statement in check.body:
        if _is_unit(statement):
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


def _check_of(tree: ast.Module) -> ast.FunctionDef:
    checks = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1:
        raise ValueError(f"a test needs exactly one top-level `def check(candidate)`; this one has {len(checks)}")
    return checks[0]


def _is_unit(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)
               for node in ast.walk(statement))


def _guarded(statement: ast.stmt, unit: int) -> ast.Try:
    wrapper = ast.parse(f"try:\n    pass\nexcept Exception as _wb_error:\n    {UNIT_HOOK}({unit}, _wb_error)\n"
                        f"else:\n    {UNIT_HOOK}({unit}, None)\n").body[0]
    wrapper.body = [statement]
    return wrapper


def _plain_calls(test: str) -> bytes:
    """The marshalled units when `check` is only units of the plain-call forms (and constant asserts) and the
    module only `check` and a METADATA dict; else b''."""
    tree = ast.parse(test)
    check = _check_of(tree)
    extra = [node for node in tree.body if node is not check and not (
        isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["METADATA"])]
    calls = []
    for statement in check.body:
        if isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Constant) and statement.test.value:
            continue  # `assert True, "..."`: no unit (a false constant fails `check`: the judge runs that)
        unit = _unit(statement, check.args.args[0].arg if check.args.args else "candidate")
        if unit is None or extra:
            return b""
        calls.append(unit)
    try:
        return marshal.dumps(calls)
    except ValueError:  # an argument or expected value marshal cannot carry
        return b""


def _unit(statement: ast.stmt, name: str) -> tuple | None:
    if not isinstance(statement, ast.Assert):
        return None
    test = statement.test

    def call(node: ast.expr) -> tuple | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name):
            return None
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        args = [_literal(a) for a in node.args]
        kwargs = {k.arg: _literal(k.value) for k in node.keywords}
        if any(a is _NOT_LITERAL for a in args) or any(v is _NOT_LITERAL for v in kwargs.values()):
            return None
        return tuple(args), kwargs

    if (made := call(test)) is not None:
        return (*made, "truthy", None)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (made := call(test.operand)):
        return (*made, "falsy", None)
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right, op = test.left, test.comparators[0], test.ops[0]
        if isinstance(op, ast.Eq) and call(right) and not call(left):
            left, right = right, left
        made, expected = call(left), _literal(right)
        if made is None or expected is _NOT_LITERAL:
            return None
        if isinstance(op, ast.Eq):
            return (*made, "==", expected)
        if isinstance(op, ast.Is) and any(expected is s for s in _SINGLETONS):
            return (*made, "is", expected)
    return None


_NOT_LITERAL = object()


def _literal(node: ast.expr):
    """The value of a literal or of constant arithmetic (`3 * 19`, `'ab' + 'c'`): the test is the problem set's
    own code, and with no names, calls or attributes in it, evaluating it runs nothing else."""
    if not all(isinstance(n, _LITERAL_NODES) for n in ast.walk(node)):
        return _NOT_LITERAL
    try:
        return eval(compile(ast.Expression(node), "<test>", "eval"), {"__builtins__": {}})
    except Exception:  # noqa: BLE001 (1 / 0, and the like: then it is no plain call)
        return _NOT_LITERAL


def run_check(sandbox: Sandbox, solution: str, test: Test, entry_point: str) -> CheckResult:
    """Run `solution` (a whole program) against `test` in `sandbox`. What the runs send back is read with bounded
    work (reading.py); a result that cannot be read, or whose verdict fails for any reason, is a failed check
    with the verdict "unreadable result", never an exception (only the sandbox itself failing raises)."""
    if test.calls:
        runs, grade = _run_calls(sandbox, solution, test, entry_point)
    else:
        runs, grade = _run_judged(sandbox, solution, test, entry_point)
    stopped = next(filter(None, (_stopped(sandbox, run) for run in runs)), "")
    if stopped:
        return CheckResult(0, test.units, False, stopped)
    try:
        return grade()
    except Exception as e:  # noqa: BLE001 (bytes from the code under test: whatever goes wrong scores 0)
        return CheckResult(0, test.units, False, reading.unreadable(f"{type(e).__name__}: {reading.show(str(e))}"))


def _run_calls(sandbox: Sandbox, solution: str, test: Test, entry_point: str):
    units = marshal.loads(test.calls)
    job = {"solution": solution, "entry_point": entry_point, "calls": [(args, kw) for args, kw, _, _ in units]}
    result = sandbox.run(_program("harness.py"), marshal.dumps(job), channel=True)

    def grade() -> CheckResult:
        outcomes = reading.frames(result.channel, len(units))
        if outcomes and _failed_to_load(outcomes[0]):
            return CheckResult(0, test.units, False, f"solution: {reading.show(outcomes[0][1:])}")
        passed, errors = 0, []
        for index, (_, _, op, expected) in enumerate(units):
            why = _verdict(outcomes[index] if index < len(outcomes) else None, op, expected)
            if why is None:
                passed += 1
            elif not errors:
                errors.append(f"unit {index}: {why}")
        finished = len(outcomes) == len(units)
        if not finished and not errors:
            errors.append(_no_answer(result))
        return CheckResult(passed, test.units, finished, errors[0] if errors else "")

    return (result,), grade


def _failed_to_load(frame) -> bool:
    return isinstance(frame, tuple) and frame[:1] == ("solution",)


def _verdict(outcome, op: str, expected) -> str | None:
    """None when the unit holds, else why not. Types are checked before anything is written out, and what is
    written goes through `reading.show`."""
    if outcome is None:
        return "no answer (the solution's process ended)"
    if not (isinstance(outcome, tuple) and len(outcome) >= 2 and isinstance(outcome[0], str)):
        return "not an answer"
    kind, value = outcome[0], outcome[1]
    if kind == "raised":
        return f"raised {reading.show(value)}: {reading.show(outcome[2] if len(outcome) > 2 else '')}"
    if kind != "value" or len(outcome) != 2:
        return f"returned a {reading.show(value)}, which is not plain data"
    holds = {"==": lambda: value == expected, "is": lambda: value is expected,
             "truthy": lambda: bool(value), "falsy": lambda: not value}[op]()
    return None if holds else f"returned {reading.show(value)}, expected {op} {reading.show(expected)}"


def _run_judged(sandbox: Sandbox, solution: str, test: Test, entry_point: str):
    requests_read, requests_write = os.pipe()
    replies_read, replies_write = os.pipe()
    solver: list[RunResult] = []
    job = {"solution": solution, "entry_point": entry_point, "requests": requests_read, "replies": replies_write}
    thread = threading.Thread(target=lambda: solver.append(
        sandbox.run(_program("harness.py"), marshal.dumps(job), channel=True, fds=(requests_read, replies_write))))
    try:
        thread.start()
    except BaseException:
        for fd in (requests_read, replies_write):
            os.close(fd)
        raise
    judge = {"test": test.source, "prelude": test.prelude, "entry_point": entry_point, "reader": _program("values.py"),
             "requests": requests_write, "replies": replies_read}
    judged = sandbox.run(_program("judge.py"), marshal.dumps(judge), channel=True, fds=(requests_write, replies_read))
    thread.join()
    if not solver:
        raise RuntimeError("sandbox: the solution's run failed to start (see the thread's traceback above)")

    def grade() -> CheckResult:
        frames = reading.frames(judged.channel, 2)
        verdict = frames[0] if len(frames) == 1 else None
        if not (isinstance(verdict, tuple) and len(verdict) == 3 and isinstance(verdict[1], list)):
            return CheckResult(0, test.units, False, f"the judge gave no verdict: {_no_answer(judged)}")
        finished, passed, error = verdict
        done = {u for u in passed if type(u) is int} & set(range(test.units))
        failed = reading.frames(solver[0].channel, 1)  # the solution's own failure to load, if any
        if failed and _failed_to_load(failed[0]):
            error = f"solution: {reading.show(failed[0][1:])}"
        text = error if isinstance(error, str) else reading.show(error)
        return CheckResult(len(done), test.units, finished is True, text[:300])

    return (solver[0], judged), grade


def _stopped(sandbox: Sandbox, result: RunResult) -> str:
    if result.timed_out:
        return f"timed out after {sandbox.limits.timeout_s:g} s"
    if result.cpu_exceeded:
        return f"used more than {sandbox.limits.cpu_s} CPU seconds"
    if result.output_capped:
        return f"printed more than {sandbox.limits.output_bytes} bytes"
    return ""


def _no_answer(result: RunResult) -> str:
    tail = " ".join(result.stderr.decode(errors="replace").split()[-30:])
    return f"no answer (exit status {result.returncode}): {tail}"


@functools.cache
def _program(name: str) -> str:
    return Path(__file__).with_name(name).read_text()

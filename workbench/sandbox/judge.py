"""The program that runs a test that is not a list of `assert candidate(...) == value` units (checks.py), in its own
sandboxed interpreter, apart from the solution's: `candidate` here is a stand-in that sends each call's
arguments to the solution's process (harness.py, through a pipe) and returns the plain value that comes back,
or raises the exception named. The test's code, its helpers and its names (`abs`, `math`) are this process's
own; no object of the solution's ever reaches it.

The job (stdin, after the result channel's number): the problem's prompt (its helpers), the entry point's name,
the instrumented test (`checks.instrument_test`), the text of values.py (this process sees no workbench), and
the descriptors of the pipes to and from the solution. The verdict, one marshal record on the result channel:
(check ran to its end, the units that passed, the first error). Standard library only.
"""

import builtins
import io
import marshal
import os
import sys

_PLAIN = (type(None), bool, int, float, complex, str, bytes, tuple, list, dict, set, frozenset)
_EXCEPTIONS = {name: value for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, Exception)}
"""Exceptions the solution's process may name, raised here as themselves (a test may expect one)."""


def _plain(value, depth: int = 0) -> bool:
    if depth > 64 or type(value) not in _PLAIN:
        return False
    if isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, (tuple, list, set, frozenset)):
        return all(_plain(v, depth + 1) for v in value)
    return True


def _send(fd: int, frame: bytes) -> None:
    frame = len(frame).to_bytes(4, "big") + frame
    while frame:
        frame = frame[os.write(fd, frame):]


def _read_exactly(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, min(size - len(data), 1 << 16))
        if not chunk:
            raise RuntimeError("the solution's process stopped before answering")
        data += chunk
    return data


def _receive(fd: int) -> bytes:
    return _read_exactly(fd, int.from_bytes(_read_exactly(fd, 4), "big"))


def _describe(error: BaseException) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def stand_in(requests: int, replies: int, loads):
    """The `candidate` the test calls; `loads` reads a reply (values.py's, not marshal.loads: the bytes are the
    solution's)."""

    def candidate(*args, **kwargs):
        _send(requests, marshal.dumps((args, kwargs)))  # ValueError: arguments that are not plain data
        try:
            outcome = loads(_receive(replies))
        except ValueError as e:
            raise RuntimeError("the solution's process sent something that is not a result") from e
        if not (isinstance(outcome, tuple) and outcome and _plain(outcome)):
            raise RuntimeError("the solution's process sent something that is not plain data")
        if outcome[0] == "value" and len(outcome) == 2:
            return outcome[1]
        if outcome[0] == "raised" and len(outcome) == 3:
            raise _EXCEPTIONS.get(outcome[1], RuntimeError)(f"the candidate raised {outcome[1]}: {outcome[2]}")
        raise TypeError(f"the candidate returned {outcome[1:]!r}, which is not plain data")

    return candidate


def main() -> None:
    raw = sys.stdin.buffer.read()
    sys.stdin.close()
    sys.stdin = io.StringIO()
    channel, _, job = raw.partition(b"\n")
    job, out = marshal.loads(job), int(channel)
    passed, errors = [], []

    def unit(index: int, error: BaseException | None) -> None:
        if error is None:
            passed.append(index)
        elif not errors:
            errors.append(f"unit {index}: {_describe(error)}")

    reader = {"__name__": "values"}
    exec(compile(job["reader"], "<values>", "exec"), reader)  # noqa: S102 (values.py, sent by the parent)
    namespace, candidate = {"__name__": "test"}, stand_in(job["requests"], job["replies"], reader["loads"])
    try:
        exec(compile(job["prelude"], "<prompt>", "exec"), namespace)  # noqa: S102 (the problem set's own code)
        namespace[job["entry_point"]] = candidate
        exec(compile(job["test"], "<test>", "exec"), namespace)  # noqa: S102
        namespace["check"](candidate, _wb_unit=unit)  # checks.UNIT_HOOK
        verdict = (True, passed, errors[0] if errors else "")
    except BaseException as e:  # noqa: BLE001 (whatever stops `check` ends the scoring, reported)
        verdict = (False, passed, f"check: {_describe(e)}")
    os.close(job["requests"])  # the solution's process sees the end of its requests and exits
    _send(out, marshal.dumps(verdict))


if __name__ == "__main__":
    main()

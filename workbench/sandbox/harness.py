"""The program that runs a solution in the sandbox (its text is `Sandbox.run`'s program; the job comes on stdin):
it runs the solution, then calls its entry point on each argument tuple it is given and sends back what each
call gave, as plain data. It judges nothing: the parent (or the test's own interpreter, judge.py) compares.

Each call's outcome is one frame (4-byte big-endian length, then a marshal record) on the result channel:
("value", v) when the call returned a value that marshal writes, ("unmarshallable", type name) when it
returned anything else (an object with its own `__eq__`, say), ("raised", type name, message) when it raised.
The calls come from the job (`calls`: the parent knows them all) or, one frame at a time, from a pipe to the
judge (`requests`/`replies`: descriptor numbers), which needs each result before it knows the next call.

What the solution does to this process (rebinding builtins, `os.write`, `marshal`, exiting early, writing
frames of its own) changes only which values arrive: a value it makes up still has to equal the expected one,
which this process never sees. Standard library only, and nothing slow to import: this runs once per
completion.
"""

import io
import marshal
import os
import sys

_dumps, _loads, _write, _read, _type, _str, _len = marshal.dumps, marshal.loads, os.write, os.read, type, str, len


def _describe(error: BaseException) -> tuple:
    try:
        return "raised", _type(error).__name__, " ".join(_str(error).split())[:300]
    except Exception:  # noqa: BLE001 (an exception whose str() raises, or a class whose name is not a str)
        return "raised", "?", ""


def _outcome(candidate, args: tuple, kwargs: dict) -> bytes:
    try:
        value = candidate(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 (SystemExit too: exceptions are data here)
        record = _describe(e)
    else:
        try:
            return _dumps(("value", value))
        except Exception:  # noqa: BLE001 (ValueError: not plain data; anything a hostile object raises)
            try:
                record = ("unmarshallable", _type(value).__name__)
            except Exception:  # noqa: BLE001
                record = ("unmarshallable", "?")
    try:
        return _dumps(record)
    except Exception:  # noqa: BLE001
        return _dumps(("raised", "?", ""))


def _send(fd: int, frame: bytes) -> None:
    frame = _len(frame).to_bytes(4, "big") + frame
    while frame:
        frame = frame[_write(fd, frame):]


def _receive(fd: int) -> bytes | None:
    head = b""
    while _len(head) < 4:
        chunk = _read(fd, 4 - _len(head))
        if not chunk:
            return None
        head += chunk
    size, body = int.from_bytes(head, "big"), b""
    while _len(body) < size:
        chunk = _read(fd, min(size - _len(body), 1 << 16))
        if not chunk:
            return None
        body += chunk
    return body


def main() -> None:
    raw = sys.stdin.buffer.read()
    sys.stdin.close()
    sys.stdin = io.StringIO()  # input() in a solution gets EOF at once
    channel, _, job = raw.partition(b"\n")
    job, out = _loads(job), int(channel)
    namespace = {"__name__": "solution"}  # not __main__: a solution's `if __name__ == "__main__":` demo stays off
    try:
        exec(compile(job["solution"], "<solution>", "exec"), namespace)  # noqa: S102 (what the sandbox is for)
        candidate = namespace[job["entry_point"]]
    except BaseException as e:  # noqa: BLE001 (SystemExit too: a solution that exits defines nothing to test)
        _send(out, _dumps(("solution", *_describe(e)[1:])))
        return
    if "calls" in job:
        for args, kwargs in job["calls"]:
            _send(out, _outcome(candidate, args, kwargs))
        return
    while (request := _receive(job["requests"])) is not None:
        args, kwargs = _loads(request)
        _send(job["replies"], _outcome(candidate, args, kwargs))


if __name__ == "__main__":
    main()

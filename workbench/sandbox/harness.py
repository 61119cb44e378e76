"""The program a sandboxed check runs (its text is `Sandbox.run`'s program; the job comes on stdin): the
solution, then the instrumented test (`checks.instrument_test`) in the solution's namespace, as HumanEval
concatenates them, then `check(entry_point)`, each scored unit reporting to `unit`.

The result is one line on stdout starting with the job's nonce, written after the solution has run and only
through a copy of stdout taken before it: a solution cannot forge it without reading the nonce out of this
process (docs/sandbox.md, "reward hacking"). Standard library only, and nothing slow to import: this runs
once per completion.
"""

import io
import marshal
import os
import sys


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # noqa: BLE001 (a solution's exception whose str() raises)
        text = type(error).__name__
    return " ".join(text.split())[:300]


def run(job: dict) -> tuple[bool, list, str]:
    """(check ran to its end, the units that passed, the first error)."""
    namespace = {"__name__": "solution"}  # not __main__: a solution's `if __name__ == "__main__":` demo stays off
    try:
        exec(compile(job["solution"], "<solution>", "exec"), namespace)  # noqa: S102 (what the sandbox is for)
        candidate = namespace[job["entry_point"]]
        exec(compile(job["test"], "<test>", "exec"), namespace)  # noqa: S102
    except BaseException as e:  # noqa: BLE001 (SystemExit too: a solution that exits defines nothing to test)
        return False, [], f"solution: {_describe(e)}"
    passed, errors = [], []

    def unit(index: int, error: BaseException | None) -> None:
        if error is None:
            passed.append(index)
        elif not errors:
            errors.append(f"unit {index}: {_describe(error)}")

    try:
        namespace["check"](candidate, _wb_unit=unit)  # the keyword is checks.UNIT_HOOK
    except BaseException as e:  # noqa: BLE001 (whatever stops `check` ends the scoring, reported)
        return False, passed, f"check: {_describe(e)}"
    return True, passed, errors[0] if errors else ""


def main() -> None:
    job = marshal.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    sys.stdin = io.StringIO()  # input() in a solution gets EOF at once
    nonce = job.pop("nonce")
    report = os.dup(1)
    finished, passed, error = run(job)
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001, S110 (the solution closed or replaced stdout; contextlib costs ms to import)
        pass
    os.write(report, f"\n{nonce} {int(finished)} {','.join(map(str, passed)) or '-'} {error}\n".encode())


if __name__ == "__main__":
    main()

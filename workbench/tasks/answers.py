"""Is a completion's answer the reference answer? The strict rule (the number after the last '####'), the
lenient one (that rule's wider regex, or math-verify finding the two equal: fractions, LaTeX \\boxed{}, units,
thousands separators, percentages), and math-verify's guard rails: a length cap, and a deadline, since short
inputs such as 9^9^9^9 would otherwise run forever inside sympy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import signal
import threading
from decimal import Decimal, InvalidOperation

# A number: optional '-' and/or '$' (spaces allowed after them), digits with thousands commas, decimals. It never
# starts at a space (that changes no normalised answer) and its spaces are possessive, so no text makes the
# search quadratic (the earlier `-?\$?\s*-?\d...` took seconds on 20k spaces).
_NUMBER = r"(?:-?\$\s*+|-\s*+)?-?\d[\d,]*(?:\.\d+)?"
MATH_VERIFY_MAX_CHARS = 1000
"""The most characters of a completion handed to math-verify (the answer's line after '####', else the tail)."""
MATH_VERIFY_TIMEOUT_S = 1.0
"""math-verify's time for one completion (parse and compare); past it the completion scores as math-verify failed."""


def normalize_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5', '-7' -> '-7', '42.0' -> '42'; None if it is no number."""
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    out = format(value.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def extract_answer(text: str, mode: str = "lenient") -> str | None:
    """The final answer of a model's output, normalised, or None (regular expressions only; linear time).

    strict: only GSM8K's '#### <number>' (the last one). lenient: that, else the last
    '\\boxed{<number>}', else the last 'answer is <number>', else the last number in the text.
    """
    if mode not in ("strict", "lenient"):
        raise ValueError(f"extraction mode must be 'strict' or 'lenient', got {mode!r}")
    patterns = [rf"####\s*({_NUMBER})"]
    if mode == "lenient":
        patterns += [rf"\\boxed\{{\s*({_NUMBER})\s*\}}", rf"answer is\s*+:?\s*+({_NUMBER})", rf"({_NUMBER})"]
    for pattern in patterns:
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return normalize_number(found[-1])
    return None


def lenient_correct(completion: str, answer: str) -> bool:
    """The lenient check: the completion's final answer equals `answer` (a normalised number).

    True when `extract_answer(completion, "lenient")` equals it (so whatever the strict rule or the earlier
    lenient rule accepts stays accepted), or else when math-verify finds them equal: fractions and LaTeX
    (`\\boxed{\\frac{1}{2}}` is 0.5), `\\$12`, `12 \\text{ dollars}`, `1/2`, thousands separators. Math-verify reads
    the rest of the line after the last '####' where there is one (the marker GSM8K asks for), else the last
    `MATH_VERIFY_MAX_CHARS` characters. A percentage is the number written: '50%' equals 50 (GSM8K writes the
    answer to a percentage question as the bare number), not 0.5. Anything that fails inside math-verify, or
    takes longer than `MATH_VERIFY_TIMEOUT_S` (a SIGALRM timer, in the main thread), is no match; in another
    thread, where no timer can interrupt sympy, spans with powers or factorials are not handed to it.
    """
    if extract_answer(completion, "lenient") == answer:
        return True
    return _math_verify_equal(_answer_span(completion), answer, _timer_usable())


def _answer_span(text: str) -> str:
    marker = text.rfind("####")
    if marker >= 0:
        return text[marker + 4:].lstrip().split("\n", 1)[0][:MATH_VERIFY_MAX_CHARS]
    return text[-MATH_VERIFY_MAX_CHARS:]


class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException, so math-verify's `except Exception` does not swallow it."""


def _timer_usable() -> bool:
    """Whether `_deadline` can arm SIGALRM: in the main thread, on a platform with it, and when no other real-time
    timer (an `alarm`, pytest-timeout) is armed, which ours would replace."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


@contextlib.contextmanager
def _deadline(seconds: float):
    """Raise `_Deadline` inside the block after `seconds` (call it only where `_timer_usable()`)."""

    def expire(signum, frame):
        raise _Deadline

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)


# Without a timer (another thread), sympy must not meet what can run for ever: powers (9^9^9^9), factorials,
# binomials. Such spans are not handed to math-verify there (the regular-expression rule still applies).
_UNBOUNDED = re.compile(r"\^|\*\*|[\d)}\]]\s*!|binom|choose", re.IGNORECASE)


class _NoTimeoutNotice(logging.Filter):
    """math-verify warns once that with its (signal-based) timeouts off we must bound the time ourselves: we do."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError("the lenient GSM8K score needs math-verify: pip install math-verify") from e
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutNotice())
    return math_verify


def _drop_percent(expr):
    """'50%' parses as 50 * UnevaluatedExpr(1/100); a percentage answer counts as the number written."""
    from sympy import Mul, Rational, UnevaluatedExpr

    if isinstance(expr, Mul) and len(expr.args) == 2 and expr.args[1] == UnevaluatedExpr(Rational(1, 100)):
        return expr.args[0]
    return expr


@functools.lru_cache(maxsize=4096)  # the trainer asks for scores and then the reward of each completion
def _math_verify_equal(span: str, answer: str, timer: bool) -> bool:
    if not span.strip() or (not timer and _UNBOUNDED.search(span)):
        return False
    mv = _math_verify()
    try:
        with _deadline(MATH_VERIFY_TIMEOUT_S) if timer else contextlib.nullcontext():
            # Its own timeouts off: they are signal.alarm (whole seconds, an error outside the main thread).
            gold = mv.parse(answer, parsing_timeout=None)
            pred = [_drop_percent(p) for p in mv.parse(span, parsing_timeout=None)]
            return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=None))
    except (Exception, _Deadline):  # a bug, a recursion limit or the deadline inside math-verify or sympy: no match
        return False

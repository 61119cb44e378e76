"""Plain data from a sandboxed child: a reader of `marshal`'s format for None, bools, numbers, strings, bytes
and tuples, lists, dicts, sets and frozensets of them, and nothing else.

Written here rather than calling `marshal.loads`, whose documentation says it is not secure against erroneous
or maliciously constructed data: what a child sends is written by the code under test, and it can build code
objects through marshal. This reader refuses code, recursion, and sizes past what the bytes can hold.
"""

from __future__ import annotations

import struct

_FLAG_REF = 0x80
MAX_DEPTH = 64
"""Nesting deeper than this is refused (no plain answer is that deep; the reader recurses)."""
MAX_INT_DIGITS = 4096
"""An int of more marshal digits (15 bits each, ~18,000 decimal digits) is refused: building one costs time
quadratic in its size."""
_PENDING = object()


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.at, self.refs = memoryview(data), 0, []

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError("truncated")
        chunk = self.data[self.at:self.at + n].tobytes()
        self.at += n
        return chunk

    def int32(self) -> int:
        return struct.unpack("<i", self.take(4))[0]

    def count(self, n: int) -> int:
        if n < 0 or n > len(self.data) - self.at:  # every item takes at least one byte
            raise ValueError(f"a size of {n}")
        return n

    def value(self, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        code = self.take(1)[0]
        ref, code = code & _FLAG_REF, chr(code & ~_FLAG_REF)
        if code == "r":
            index = self.int32()
            if not 0 <= index < len(self.refs) or self.refs[index] is _PENDING:
                raise ValueError("a bad or recursive reference")
            return self.refs[index]
        slot = len(self.refs)
        if ref:
            self.refs.append(_PENDING)
        result = self.scalar(code) if code in _SCALARS else self.container(code, depth)
        if ref:
            self.refs[slot] = result
        return result

    def scalar(self, code: str):
        if code in _SCALARS and _SCALARS[code] is not None:
            return _SCALARS[code][0]
        if code == "i":
            return self.int32()
        if code == "l":
            n = self.int32()
            if abs(n) > MAX_INT_DIGITS:
                raise ValueError(f"an int of {abs(n)} digits")
            digits = struct.unpack(f"<{abs(n)}H", self.take(2 * abs(n)))
            if any(d >= 1 << 15 for d in digits):
                raise ValueError("a bad int digit")
            total = 0
            for digit in reversed(digits):
                total = (total << 15) | digit
            return -total if n < 0 else total
        if code == "g":
            return struct.unpack("<d", self.take(8))[0]
        if code == "y":
            real, imag = struct.unpack("<dd", self.take(16))
            return complex(real, imag)
        if code == "s":
            return self.take(self.count(self.int32()))
        if code in "ut":
            return self.take(self.count(self.int32())).decode("utf-8", "surrogatepass")
        if code in "aA":
            return self.take(self.count(self.int32())).decode("ascii")
        return self.take(self.take(1)[0]).decode("ascii")  # 'z', 'Z': short ascii

    def container(self, code: str, depth: int):
        if code == ")":
            return tuple(self.value(depth + 1) for _ in range(self.take(1)[0]))
        if code in "([<>":
            items = [self.value(depth + 1) for _ in range(self.count(self.int32()))]
            return {"(": tuple, "[": list, "<": set, ">": frozenset}[code](items)
        if code == "{":
            result = {}
            while self.data[self.at:self.at + 1] != b"0":
                key = self.value(depth + 1)
                result[key] = self.value(depth + 1)
            self.take(1)
            return result
        raise ValueError(f"marshal type {code!r} is not plain data")


_SCALARS = {"N": (None,), "F": (False,), "T": (True,), ".": (Ellipsis,), **dict.fromkeys("ilgysutaAzZ")}


def loads(data: bytes):
    """The plain value `data` holds (one marshal record, nothing after it); ValueError for anything else."""
    reader = _Reader(data)
    try:
        value = reader.value()
    except (struct.error, UnicodeDecodeError, TypeError, RecursionError) as e:  # TypeError: an unhashable key
        raise ValueError(f"not plain data: {e}") from None
    if reader.at != len(data):
        raise ValueError(f"{len(data) - reader.at} bytes after the value")
    return value

"""Plain data from a sandboxed child: a reader of `marshal`'s format for None, bools, numbers, strings, bytes
and tuples, lists, dicts, sets and frozensets of them, and nothing else, with bounded work.

Written here rather than calling `marshal.loads`, whose documentation says it is not secure against erroneous
or maliciously constructed data: what a child sends is written by the code under test, and it can build code
objects through marshal. This reader refuses code, recursion, and sizes past what the bytes can hold.

Bounded work: a few bytes of marshal can describe a value whose use costs exponential or quadratic time in C,
with the GIL held, where no thread, timeout or Ctrl-C can stop it. So the reader counts what each value costs
to use and refuses (ValueError) past the budget:

- back-references (marshal shares a repeated object) are expanded under the node budget: a value counts as
  many nodes as its tree has with every reference written out, so `x = [x, x]` sixty times (2^60 leaves to
  repr, hash or compare) is refused, while an honest repeated string costs its size each time;
- an int has at most MAX_INT_DIGITS digits, so `str` and `repr` of it work (Python refuses past 4,300
  decimal digits) and building it stays linear (marshal's own C reader does, on that record alone);
- a set, frozenset or dict costs its items times its nodes more, the worst case of inserting items whose
  hashes all collide (each insertion compares with every item before it).
"""

from __future__ import annotations

import marshal
import struct

_FLAG_REF = 0x80
MAX_DEPTH = 64
"""Nesting deeper than this is refused (no plain answer is that deep; the reader recurses)."""
MAX_INT_DIGITS = 952
"""The most marshal digits (15 bits each) of an int: 14,280 bits, under 4,300 decimal digits (Python's limit
on int-to-text conversion), so every int read can be written out."""
MAX_NODES = 1 << 16
"""Values in one record, back-references expanded (each container, scalar and reference target counts)."""
MAX_HASH_WORK = 1 << 22
"""Items times nodes, summed over the record's sets, frozensets and dicts: what inserting them costs when every
hash collides."""
_PENDING = object()


class _Reader:
    def __init__(self, data: bytes, max_nodes: int):
        self.data, self.at, self.refs = memoryview(data), 0, []
        self.nodes, self.max_nodes, self.hash_work = 0, max_nodes, 0

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

    def spend(self, nodes: int) -> None:
        self.nodes += nodes
        if self.nodes > self.max_nodes:
            raise ValueError(f"more than {self.max_nodes} values (back-references expanded)")

    def value(self, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        code = self.take(1)[0]
        ref, code = code & _FLAG_REF, chr(code & ~_FLAG_REF)
        if code == "r":
            index = self.int32()
            if not 0 <= index < len(self.refs) or self.refs[index][0] is _PENDING:
                raise ValueError("a bad or recursive reference")
            value, size = self.refs[index]
            self.spend(size)  # used again: it costs its whole tree again
            return value
        slot, before = len(self.refs), self.nodes
        if ref:
            self.refs.append((_PENDING, 0))
        self.spend(1)
        result = self.scalar(code) if code in _SCALARS else self.container(code, depth)
        if ref:
            self.refs[slot] = (result, self.nodes - before)
        return result

    def scalar(self, code: str):
        if code in _SCALARS and _SCALARS[code] is not None:
            return _SCALARS[code][0]
        if code == "i":
            return self.int32()
        if code == "l":
            n = self.int32()
            if abs(n) > MAX_INT_DIGITS:
                raise ValueError(f"an int of {abs(n)} digits (at most {MAX_INT_DIGITS})")
            # marshal's C reader on this one int record: linear time, and it checks the digits.
            return marshal.loads(b"l" + struct.pack("<i", n) + self.take(2 * abs(n)))
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
        if code in "([":
            items = [self.value(depth + 1) for _ in range(self.count(self.int32()))]
            return tuple(items) if code == "(" else items
        start = self.nodes
        if code in "<>":
            items = [self.value(depth + 1) for _ in range(self.count(self.int32()))]
            self.hashed(len(items), self.nodes - start)
            return (set if code == "<" else frozenset)(items)
        if code == "{":
            pairs = []
            while self.data[self.at:self.at + 1] != b"0":
                pairs.append((self.value(depth + 1), self.value(depth + 1)))
            self.take(1)
            self.hashed(len(pairs), self.nodes - start)
            return dict(pairs)
        raise ValueError(f"marshal type {code!r} is not plain data")

    def hashed(self, items: int, nodes: int) -> None:
        self.hash_work += items * nodes
        if self.hash_work > MAX_HASH_WORK:
            raise ValueError(f"sets and dicts too large to hash in bounded time ({items} items of {nodes} values)")


_SCALARS = {"N": (None,), "F": (False,), "T": (True,), ".": (Ellipsis,), **dict.fromkeys("ilgysutaAzZ")}


def read(data: bytes, max_nodes: int = MAX_NODES) -> tuple[object, int]:
    """(the plain value `data` holds, the nodes it counted): one marshal record, nothing after it; ValueError for
    anything else, or past `max_nodes`, MAX_INT_DIGITS, MAX_HASH_WORK."""
    reader = _Reader(data, max_nodes)
    try:
        value = reader.value()
    except (struct.error, UnicodeDecodeError, TypeError, RecursionError, EOFError) as e:  # TypeError: unhashable
        raise ValueError(f"not plain data: {e}") from None
    if reader.at != len(data):
        raise ValueError(f"{len(data) - reader.at} bytes after the value")
    return value, reader.nodes


def loads(data: bytes):
    """The plain value `data` holds (one marshal record, nothing after it); ValueError for anything else."""
    return read(data)[0]

"""Reading a run's result channel in the trainer with bounded work, and showing what was read.

Everything here runs in the trainer's process on bytes written by the code under test, so none of it may spin
or raise: `frames` reads at most the frames the check asked for, under one node budget for them all
(values.py bounds each value's cost to use: back-references expanded, int sizes, hashing), and `show` writes
a value for a verdict with `reprlib`'s limits, inside a handler. What cannot be read is the verdict
UNREADABLE (reward 0), logged.
"""

from __future__ import annotations

import logging
import reprlib

from . import values

UNREADABLE = "unreadable result"
"""The verdict of a run whose result is not plain data within the bounds (values.py): reward 0."""
MAX_NODES = values.MAX_NODES
"""Values in all of one run's frames together (back-references expanded)."""
_LOG = logging.getLogger(__name__)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 3, 60, 60, 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 6


class Unreadable(ValueError):
    """A run's result that is not plain data within the bounds."""


def frames(data: bytes, most: int) -> list:
    """The plain values of the first `most` length-prefixed frames in `data` (a truncated tail is dropped, so is
    anything past `most`); Unreadable when a frame is not plain data or all together pass MAX_NODES."""
    found, at, left = [], 0, MAX_NODES
    while len(found) < most and at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        if at + 4 + size > len(data):
            break
        try:
            value, nodes = values.read(data[at + 4:at + 4 + size], left)
        except ValueError as e:
            raise Unreadable(f"frame {len(found)}: {e}") from None
        found.append(value)
        left -= nodes
        at += 4 + size
    return found


def show(value) -> str:
    """`value` written out for a verdict, at most a few hundred characters, whatever it is."""
    try:
        return _REPR.repr(value)
    except Exception as e:  # noqa: BLE001 (a verdict's text must never stop the trainer)
        return f"a {type(value).__name__} that cannot be written out ({type(e).__name__})"


def unreadable(why: str) -> str:
    """The verdict for an unreadable result, logged (one line)."""
    _LOG.warning("sandbox: %s: %s", UNREADABLE, why)
    return f"{UNREADABLE}: {why}"

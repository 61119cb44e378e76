"""A grid of config overrides: `field=v1,v2` per axis, each value checked against a config dataclass (the same
checks as a `key=value` override), the cartesian product in a stable order, and one folder name per point.

A point is finished when its marker (`finished.json`, written atomically after it ran to the end) exists; the
marker keeps the point's settings, so a rerun skips it, and a rerun with other settings for that folder is an
error rather than a silent mix of two runs.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

from ..config import parse_overrides

FINISHED = "finished.json"
"""A point's marker: written into its folder once it ran to the end."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+-]")
_OPEN, _CLOSE = "[{(", "]})"


def split_values(text: str) -> list[str]:
    """'1e-5,3e-5' -> ['1e-5', '3e-5']; commas inside brackets or quotes do not split ('[0,1],[2]', '"a,b",c')."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _unquote(text: str) -> str:
    """A value written in quotes (to hold a comma) without them."""
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


def parse_grid(items: list[str] | tuple[str, ...], cls: type, folder_field: str) -> dict[str, list]:
    """['lr=1e-5,3e-5', 'seed=0,1,2', 'steps=2'] -> {'lr': [1e-05, 3e-05], 'seed': [0, 1, 2], 'steps': [2]}, each
    value typed and checked by `cls`'s fields. `folder_field` (the run's folder) belongs to the sweep."""
    axes: dict[str, list] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"grid item {item!r} must be field=value or field=v1,v2,...")
        if key == folder_field:
            raise ValueError(f"grid item {item!r}: {key} is set by the sweep (a folder per point below its out_root); "
                             "choose the sweep's folder with out_root (--out-root)")
        if key in axes:
            raise ValueError(f"grid: {key} is given twice; put all its values in one item ({key}=a,b)")
        if not text.strip():
            raise ValueError(f"grid item {item!r} has no value: give {key}=v1,v2,..., or leave the item out")
        try:
            values = [parse_overrides([f"{key}={_unquote(v)}"], cls)[key] for v in split_values(text)]
        except ValueError as e:  # parse_overrides says 'override: ...'; here it is the grid item
            raise ValueError(f"grid item {item!r}: {str(e).removeprefix('override: ')}") from None
        if len(set(map(repr, values))) < len(values):
            raise ValueError(f"grid item {item!r} repeats a value; each point must differ")
        axes[key] = values
    return axes


def swept(axes: dict[str, list]) -> list[str]:
    """The fields that take more than one value (the others are settings shared by every point)."""
    return [k for k, v in axes.items() if len(v) > 1]


def points(axes: dict[str, list]) -> list[dict]:
    """Every combination, the first axis outermost: the order the points run in."""
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def format_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "+".join(map(format_value, value))
    return str(value)


def point_name(point: dict, fields: list[str]) -> str:
    """The folder of a point, from its swept fields in alphabetical order (so reordering the grid's items keeps
    the names): 'lr=1e-05,seed=0'; characters unsafe in a file name become '_'. A grid of one point: 'single'."""
    if not fields:
        return "single"
    return _UNSAFE.sub("_", ",".join(f"{k}={format_value(point[k])}" for k in sorted(fields)))


def point_names(grid: list[dict], fields: list[str]) -> list[str]:
    """A distinct folder name per point, or an error naming the points that would share one."""
    names = [point_name(p, fields) for p in grid]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise ValueError(f"grid points would share the folder {clash[0]!r} (their values differ only in characters "
                         "a file name cannot hold); make the values differ in letters or digits")
    return names


def _jsonable(settings: dict) -> dict:
    return json.loads(json.dumps(settings))  # tuples as lists: what the marker reads back


def finished(marker: Path, settings: dict) -> bool:
    """Whether the point with these settings finished; its marker holding other settings is an error."""
    if not marker.exists():
        return False
    saved = json.loads(marker.read_text())["settings"]
    now = _jsonable(settings)
    changed = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
    if changed:
        raise ValueError(f"{marker} records a finished run with other settings {changed} (saved, now); rerun "
                         "with its settings, or give the sweep another out_root (--out-root)")
    return True


def mark_finished(marker: Path, settings: dict, **record) -> None:
    """Write the marker (with `record`: what else to keep, e.g. the seconds it took)."""
    write_atomic(marker, json.dumps({"settings": _jsonable(settings), **record}, indent=1))


def write_atomic(path: Path, text: str) -> None:
    """A kill while writing leaves the previous file (or none), never half of the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)

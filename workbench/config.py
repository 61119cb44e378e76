"""Experiment configs: one dataclass per experiment, shared by the command line and the notebooks.

Each field carries a one-line docstring (the string literal right under it);
`field_docs` reads them back so the command line can show them as help.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import math
import textwrap
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def check_positive(name: str, value) -> None:
    """A finite number > 0, or a ValueError that names the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_at_least_one(obj, *names: str) -> None:
    """Integer fields that must be >= 1."""
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(obj, name)}")


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring} for a dataclass whose fields are followed by string literals."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --option per field, typed from the annotation, the field docstring as help."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{docs.get(f.name, '')} (default: {default!r})"
        origin = typing.get_origin(tp)
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif origin is tuple:
            (item, *_) = typing.get_args(tp)
            parser.add_argument(flag, type=item, nargs="+", default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = getattr(ns, f.name)
        values[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**values)

"""Experiment configs: one dataclass per experiment, shared by the command line, config files and the notebooks.

Each field carries a one-line docstring (the string literal right under it);
`field_docs` reads them back so the command line can show them as help.

A run's settings can live in a file (YAML, or TOML as torchtitan keeps them), with `key=value` overrides on
the command line; both are checked against the same dataclass (`read_config_file`, `parse_overrides`), and
`write_config` records the resolved settings next to a run's metrics.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import tomllib
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .files import read_text

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans (true/false only). YAML 1.1 also reads on/off/yes/no/y/n as booleans, which
    turns the arm names of `arms=[on, off]` into True/False; here those words stay strings, and a bool field reads
    them back as booleans (`_BOOL_WORDS`)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))

_BOOL_WORDS = {"yes": True, "y": True, "on": True, "no": False, "n": False, "off": False}
"""YAML 1.1's other boolean words, for bool fields (files written for PyYAML's default reading)."""


def _load_yaml(text: str):
    return yaml.load(text, Loader=_Loader)


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
        # argparse %-formats help texts: a literal % (e.g. "~15% more compute") must be doubled.
        help_ = f"{docs.get(f.name, '')} (default: {default!r})".replace("%", "%%")
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


def _unknown(where: str, key: str, cls: type) -> ValueError:
    names = [f.name for f in dataclasses.fields(cls)]
    near = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid settings: {', '.join(names)}"
    return ValueError(f"{where}: unknown setting {key!r} for {cls.__name__}{hint}")


def _typed(where: str, name: str, value, tp):
    """`value` (from YAML, TOML or a key=value) as field type `tp`, or a ValueError naming the field."""
    origin = typing.get_origin(tp)
    if origin is tuple and isinstance(value, (list, tuple)):
        (item, *_) = typing.get_args(tp)
        return tuple(_typed(where, name, v, item) for v in value)
    if origin is tuple:
        raise ValueError(f"{where}: {name} is a list: {name}=[{value}]")
    if tp is bool and isinstance(value, str) and value.lower() in _BOOL_WORDS:
        value = _BOOL_WORDS[value.lower()]
    if tp in (int, float) and isinstance(value, str):
        try:  # PyYAML reads 1e-5 (no dot) as a string
            value = tp(value)
        except ValueError:
            pass
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(tp)
    if not ok:
        raise ValueError(f"{where}: {name} must be {getattr(tp, '__name__', tp)}, got {value!r}")
    return float(value) if tp is float else value


def check_values(where: str, values: dict, cls: type) -> dict:
    """The values, typed by `cls`'s fields; unknown keys and wrong types are errors naming the key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        if key not in fields:
            raise _unknown(where, key, cls)
        out[key] = _typed(where, key, value, hints[key])
    return out


def read_config_file(path: str | Path, cls: type) -> dict:
    """A run's settings from a .yaml/.yml or .toml file (a flat table of `cls`'s fields), typed and checked."""
    p = Path(path)
    text = read_text(p, "config file")
    try:
        if p.suffix in (".yaml", ".yml"):
            data = _load_yaml(text)
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ValueError(f"config file {p}: unknown format {p.suffix!r}; use .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"config file {p} does not parse: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a table of settings (key: value), got {type(data).__name__}")
    return check_values(f"config file {p}", data, cls)


def parse_overrides(items: list[str], cls: type) -> dict:
    """['lr=1e-5', 'seeds=[0, 1, 2]', ...] -> typed values (each value read as YAML: numbers, booleans, lists)."""
    hints = typing.get_type_hints(cls)
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} must be key=value")
        if hints.get(key) is str:  # a name or a path, kept as typed even where it reads as a number
            values[key] = text
            continue
        try:
            values[key] = _load_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            values[key] = text
    return check_values("override", values, cls)


def write_config(cfg, path: str | Path) -> None:
    """The resolved settings of a run, as YAML (readable back by `read_config_file`)."""
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    Path(path).write_text(f"# {type(cfg).__name__}: the resolved settings of this run\n"
                          + yaml.safe_dump(values, sort_keys=False))

"""Experiment configs: one dataclass per experiment, shared by the command line, config files and the notebooks.

Each field carries a one-line docstring (the string literal right under it);
`field_docs` reads them back so the command line can show them as help.

A run's settings can live in a file (YAML, or TOML as torchtitan keeps them), with `key=value` overrides on
the command line; both are checked against the same dataclass (`read_config_file`, `parse_overrides`), and
`write_config` records the resolved settings next to a run's metrics.

A field whose type is itself a config dataclass is a group (`TrainConfig.optim`, an `OptimConfig`), and a group
may hold groups (`OnOffConfig.run`, a `TrainConfig`). A setting is named by its dotted path (`run.optim.lr`), by a
path that names an inner group's setting by its bare name (`run.lr`), or, where no other field or group has the
name, by its bare name (`lr`): on the command line, in files (flat, or nested tables), and in the constructor (and
`dataclasses.replace`) of a class marked `@flat_names`. Code reads the real path (`cfg.optim.lr`); `flat_dict`
gives a config's settings by those bare names, the layout records and checkpoints keep.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
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


def _choices_error(name: str, value, choices: tuple) -> ValueError:
    *first, last = [repr(c) for c in choices]
    listed = f"{', '.join(first)} or {last}" if first else last
    return ValueError(f"{name} must be {listed}, got {value!r}")


def check_choices(obj) -> None:
    """Every `Literal[...]` field of a config holds one of its values, or a ValueError that names the field."""
    for name, tp in typing.get_type_hints(type(obj)).items():
        if typing.get_origin(tp) is typing.Literal and getattr(obj, name) not in typing.get_args(tp):
            raise _choices_error(name, getattr(obj, name), typing.get_args(tp))


def check_non_negative(obj, *names: str) -> None:
    """Number fields that must be finite and >= 0."""
    for name in names:
        value = getattr(obj, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


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


def _groups(cls: type) -> dict[str, type]:
    """{field name: its config class} for the fields of `cls` that are groups of settings."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _default(cls: type, name: str):
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


@functools.cache
def settings(cls: type) -> tuple[dict[str, type], dict[str, str]]:
    """({dotted path: type} of every setting of `cls`, {bare name: dotted path} of its groups' settings whose
    bare name no field of `cls` and no other group has)."""
    hints, groups = typing.get_type_hints(cls), _groups(cls)
    types, found = {}, {}
    for f in dataclasses.fields(cls):
        if f.name not in groups:
            types[f.name] = hints[f.name]
            continue
        inner, aliases = settings(groups[f.name])
        for path, tp in inner.items():
            types[f"{f.name}.{path}"] = tp
        for bare in dict.fromkeys([*aliases, *(p for p in inner if "." not in p)]):
            found.setdefault(bare, []).append(f"{f.name}.{aliases.get(bare, bare)}")
    return types, {bare: paths[0] for bare, paths in found.items() if len(paths) == 1 and bare not in types}


def canonical(cls: type, key: str) -> str | None:
    """The dotted path of setting `key` (a field, a dotted path, a group setting's unique bare name, or a group's
    name followed by a name its class takes: `run.lr` for `run.optim.lr`)."""
    types, aliases = settings(cls)
    if key in types or key in aliases:
        return key if key in types else aliases[key]
    group, _, rest = key.partition(".")
    inner = canonical(_groups(cls)[group], rest) if rest and group in _groups(cls) else None
    return f"{group}.{inner}" if inner else None


def _names(cls: type) -> list[str]:
    """Every name `canonical` takes for `cls`'s settings (for the suggestions of an unknown one)."""
    groups = _groups(cls)
    own = [f.name for f in dataclasses.fields(cls) if f.name not in groups]
    return [*own, *settings(cls)[1], *(f"{g}.{n}" for g, inner in groups.items() for n in _names(inner))]


def _setting_docs(cls: type) -> dict[str, str]:
    """{name: docstring} of `cls`'s own fields and its groups' settings by bare name."""
    docs = field_docs(cls)
    for bare, path in settings(cls)[1].items():
        *groups, name = path.split(".")
        owner = cls
        for group in groups:
            owner = _groups(owner)[group]
        docs[bare] = field_docs(owner).get(name, "")
    return docs


def get_setting(cfg, key: str):
    """The value of setting `key` (any name `canonical` takes) of config `cfg`."""
    path = canonical(type(cfg), key)
    if path is None:
        raise _unknown("get_setting", key, type(cfg))
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def flat_dict(cfg) -> dict:
    """`dataclasses.asdict(cfg)`, with each group whose settings all go by their bare names in `cfg` merged into it
    under those names: a TrainConfig as one flat table (the layout of the checkpoints and records written before
    it had groups, so that they compare key by key), an OnOffConfig's `run` as a table of its own (its out_dir is
    the experiment's)."""
    cls = type(cfg)
    groups, aliases = _groups(cls), settings(cls)[1]
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(cfg, f.name)
        if f.name not in groups:
            out[f.name] = value
            continue
        inner = flat_dict(value)
        if all(aliases.get(k) == f"{f.name}.{canonical(groups[f.name], k)}" for k in inner):
            out.update(inner)
        else:
            out[f.name] = inner
    return out


def options(cls: type) -> dict[str, tuple[type, object]]:
    """{name: (type, default)} of the command-line options: own fields and groups' settings by bare name."""
    types, aliases = settings(cls)
    out = {name: (tp, _default(cls, name)) for name, tp in types.items() if "." not in name}
    for bare, path in aliases.items():
        group, _, rest = path.partition(".")
        value = _default(cls, group)
        for part in rest.split("."):
            value = getattr(value, part)
        out[bare] = (types[path], value)
    return out


def flat_names(cls: type[T]) -> type[T]:
    """Let `cls(...)` and `dataclasses.replace` take its groups' settings by bare or dotted name, each applied to
    the group given (or its default): `OnOffConfig(lr=1e-5)` is `OnOffConfig(run=replace(default run, lr=1e-5))`."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **values):
        init(self, **nest(cls, values))

    cls.__init__ = __init__
    return cls


def nest(cls: type, values: dict, base=None) -> dict:
    """`values` by field of `cls`: settings named by dotted path or bare name go into their group (a dataclass
    given for it, else `base`'s, else its default), and so on into the groups it holds; a group given as a dict
    (a nested table) is read as its settings."""
    groups = _groups(cls)
    out, inner = {}, {g: {} for g in groups}
    for key, value in values.items():
        if key in groups and isinstance(value, dict):
            inner[key].update(value)
            continue
        if key in {f.name for f in dataclasses.fields(cls)}:
            out[key] = value
            continue
        path = canonical(cls, key)
        if path is None:
            raise TypeError(str(_unknown(cls.__name__, key, cls)))
        group, _, rest = path.partition(".")
        inner[group][rest] = value
    for group, changes in inner.items():
        if changes:
            if group in out:
                start = out[group]
            else:
                start = getattr(base, group) if base is not None else _default(cls, group)
            out[group] = dataclasses.replace(start, **nest(groups[group], changes, start))
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One --option per field (and per group setting with a unique bare name), typed from the annotation, the
    field docstring as help."""
    docs = _setting_docs(cls)
    for name, (tp, default) in options(cls).items():
        flag = "--" + name.replace("_", "-")
        # argparse %-formats help texts: a literal % (e.g. "~15% more compute") must be doubled.
        help_ = f"{docs.get(name, '')} (default: {default!r})".replace("%", "%%")
        origin = typing.get_origin(tp)
        if origin is typing.Literal:  # checked by the config, whose message names the choices
            tp = type(typing.get_args(tp)[0])
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif origin is tuple:
            (item, *_) = typing.get_args(tp)
            parser.add_argument(flag, type=item, nargs="+", default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def namespace_values(cls: type, ns: argparse.Namespace) -> dict[str, Any]:
    """{option name: value} of the options `add_arguments` gave `cls`."""
    return {name: tuple(v) if isinstance(v := getattr(ns, name), list) else v for name in options(cls)}


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    return cls(**nest(cls, namespace_values(cls, ns)))


def _unknown(where: str, key: str, cls: type) -> ValueError:
    types, aliases = settings(cls)
    names = [*(n for n in types if "." not in n), *aliases]
    near = difflib.get_close_matches(key, _names(cls), n=1)
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
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{where}: {_choices_error(name, value, typing.get_args(tp))}")
        return value
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


def _flatten(values: dict, groups: dict[str, type], prefix: str = "") -> dict:
    """A nested table's group tables as dotted keys (`run: {lr: 1}` -> `run.lr: 1`)."""
    out = {}
    for key, value in values.items():
        if key in groups and isinstance(value, dict):
            out.update(_flatten(value, _groups(groups[key]), f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def check_values(where: str, values: dict, cls: type) -> dict:
    """The values, typed by `cls`'s settings (fields, dotted paths, groups' unique bare names; a group's nested
    table becomes dotted keys); unknown keys and wrong types are errors naming the key."""
    types = settings(cls)[0]
    out = {}
    for key, value in _flatten(values, _groups(cls)).items():
        path = canonical(cls, key)
        if path is None:
            raise _unknown(where, key, cls)
        out[key] = _typed(where, key, value, types[path])
    return out


def canonical_values(cls: type, values: dict) -> dict:
    """`values` keyed by dotted path, so that one setting given by two names is one key (the later wins)."""
    out = {}
    for key, value in values.items():
        path = canonical(cls, key) or key
        out.pop(path, None)
        out[path] = value
    return out


def read_config_file(path: str | Path, cls: type) -> dict:
    """A run's settings from a .yaml/.yml or .toml file (a table of `cls`'s settings, flat or with a group's as a
    nested table), typed and checked."""
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
    types = settings(cls)[0]
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} must be key=value")
        tp = types.get(canonical(cls, key) or "")
        if tp is str or typing.get_origin(tp) is typing.Literal:  # a name or a path, kept as typed even where it reads as a number
            values[key] = text
            continue
        try:
            values[key] = _load_yaml(text) if text.strip() else ""
        except yaml.YAMLError:
            values[key] = text
    return check_values("override", values, cls)


def write_config(cfg, path: str | Path) -> None:
    """The resolved settings of a run, as YAML (readable back by `read_config_file`)."""
    def plain(v):
        return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v

    values = plain(dataclasses.asdict(cfg))
    Path(path).write_text(f"# {type(cfg).__name__}: the resolved settings of this run\n"
                          + yaml.safe_dump(values, sort_keys=False))

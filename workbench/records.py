"""The record folders under docs/results: one `result.json` each, and the index generated from them.

A record folder holds `README.md` (a card generated from result.json under its title, then its tables and story),
`result.json` (a `Record`) and its raw files. `docs/results/index.json` and the list in docs/results/README.md are
generated from the result.json files by `python -m workbench.records` (`--check` only reports what is stale). Code
finds published folders through `load_index`, never by parsing their names.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from .tables import project_path

KINDS = {"onoff": "RL, ON and OFF", "rl": "RL, ON and OFF", "nightly": "Parity: generator, trainer, real models",
         "parity": "Parity: generator, trainer, real models", "speed": "Speed (current figures in BENCHMARKS.md)"}
"""A record's kind -> the section of the README list it is shown in. `onoff` is a published ON/OFF report
(`workbench on-off --publish`, with summary.md), `nightly` a published full-scale nightly (`nightly.py`)."""

_CARD_START = "<!-- record card: generated from result.json by `python -m workbench.records`; edit result.json -->"
_CARD_END = "<!-- end of record card -->"
_LIST_START = "<!-- index: generated from the result.json files by `python -m workbench.records` -->"
_LIST_END = "<!-- end of index -->"
HEADLINE = "headline / "
"""The prefix of the figures BENCHMARKS.md quotes, given with their baselines and floors; the card shows them."""


@dataclass(frozen=True)
class Figure:
    """One measured number of a record."""

    value: float
    """The number as the record's tables print it."""
    unit: str = ""
    """Its unit ("ms", "tok/s", "x", ...; empty for a count or a ratio without one)."""
    baseline: float | None = None
    """The same run's baseline figure it is compared with, where the record names one."""
    floor: float | None = None
    """The hardware floor it is held against, where the record names one."""


@dataclass(frozen=True)
class Record:
    """What one folder of docs/results measured, machine-readable (its result.json)."""

    folder: str
    """The folder's name under docs/results."""
    kind: str
    """One of KINDS."""
    question: str
    """What the measurement asked."""
    figures: dict[str, Figure]
    """Name ("<table> / <row> / <column>") -> figure, from the record's own tables."""
    device: str
    """The device it ran on ("NVIDIA H200", "4 x NVIDIA H200", "CPU")."""
    commit: str
    """The git commit it measured."""
    date: str
    """The day of the measurement, YYYY-MM-DD."""
    command: str
    """The command that produced it."""
    verdict: str
    """What it found, in one paragraph."""
    environment: str = ""
    """Versions and settings beyond the device (torch, Triton, vLLM), where the record gives them."""
    preset: str = ""
    """The name an ON/OFF report was published under (kind `onoff` only): its preset, with a suffix where the run
    changed the preset's arms or stack (`blog-vllm` ran `blog` with vLLM's arms); `published_results` shows the newest
    of each."""
    smoke: bool = False
    """A smoke-sized run (never shown as a published result)."""

    def to_json(self) -> dict:
        data = asdict(self)
        data["figures"] = {name: {k: v for k, v in asdict(f).items() if v is not None and v != ""}
                           for name, f in self.figures.items()}
        return data

    @classmethod
    def from_json(cls, data: dict, where: str) -> Record:
        """The record in `data`; ValueError naming `where` and the problem when it does not follow the schema."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a record is a JSON object, got {type(data).__name__}")
        if unknown := set(data) - names:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; a record has {sorted(names)}")
        if missing := required - set(data):
            raise ValueError(f"{where}: missing keys {sorted(missing)}; add them to result.json")
        if data["kind"] not in KINDS:
            raise ValueError(f"{where}: kind {data['kind']!r} is not one of {sorted(KINDS)}")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(data["date"])):
            raise ValueError(f"{where}: date {data['date']!r} is not YYYY-MM-DD")
        for key in ("question", "device", "commit", "command", "verdict"):
            if not isinstance(data[key], str) or not data[key].strip():
                raise ValueError(f"{where}: {key} must be a non-empty string")
        if not isinstance(data.get("preset", ""), str) or not isinstance(data.get("environment", ""), str):
            raise ValueError(f"{where}: preset and environment are strings")
        if not isinstance(data.get("smoke", False), bool):
            raise ValueError(f"{where}: smoke is true or false, got {data['smoke']!r}")
        if not isinstance(data["figures"], dict):
            raise ValueError(f"{where}: figures is an object of name -> {{value, unit, baseline?, floor?}}")
        figures = {}
        for name, fig in data["figures"].items():
            try:
                figures[name] = Figure(**fig)
            except TypeError as err:
                raise ValueError(f"{where}: figure {name!r}: {err}") from None
            if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in
                       (fig["value"], fig.get("baseline", 0), fig.get("floor", 0))):
                raise ValueError(f"{where}: figure {name!r} has a value that is not a finite number")
        return cls(**{**data, "figures": figures})


def read_record(folder: str | Path) -> Record:
    """The folder's result.json as a Record."""
    path = Path(folder) / "result.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: every record folder has one (see docs/results/README.md)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    record = Record.from_json(data, str(path))
    if record.folder != Path(folder).name:
        raise ValueError(f"{path}: folder {record.folder!r} is not the folder's name {Path(folder).name!r}")
    return record


def card(record: Record) -> str:
    """The README's record card: question, command, environment, headline figures and verdict as result.json has
    them."""
    env = ", ".join(p for p in (record.device, f"commit {record.commit}", record.date, record.environment) if p)
    show = lambda v, unit="": "" if v is None else f"{v:,g} {unit}".strip()  # noqa: E731
    table = [f"| {name.removeprefix(HEADLINE)} | {show(f.value, f.unit)} | {show(f.baseline, f.unit)} | "
             f"{show(f.floor, f.unit)} |" for name, f in record.figures.items() if name.startswith(HEADLINE)]
    if table:
        table = ["| figure | value | baseline, same run | floor |", "|---|---|---|---|", *table, ""]
    return "\n".join([_CARD_START, "", f"**Question.** {record.question}", "", "**Command.**", "",
                      *(f"    {line}" for line in record.command.splitlines()), "",
                      f"**Environment.** {env}", "", f"**Verdict.** {record.verdict}", "", *table,
                      f"All {len(record.figures)} figures of this folder's tables: `result.json`.", "", _CARD_END])


def with_card(readme: str, record: Record) -> str:
    """`readme` with its record card replaced, or put under its title where it has none."""
    block = card(record)
    if _CARD_START in readme:
        return re.sub(re.escape(_CARD_START) + ".*?" + re.escape(_CARD_END), lambda _: block, readme, flags=re.S)
    title, _, rest = readme.partition("\n")
    return f"{title}\n\n{block}\n{rest}" if title.startswith("# ") else f"{block}\n\n{readme}"


def write_record(folder: str | Path, record: Record) -> Path:
    """Write result.json into `folder` and the card into its README.md (created with the question as its title)."""
    folder = Path(folder)
    (folder / "result.json").write_text(json.dumps(record.to_json(), indent=1, ensure_ascii=False) + "\n")
    readme = folder / "README.md"
    text = readme.read_text() if readme.exists() else f"# {record.question}\n"
    readme.write_text(with_card(text, record))
    return folder / "result.json"


def build_index(root: str | Path = "docs/results") -> list[Record]:
    """Every record folder's Record under `root` (a relative root is the project's), newest first."""
    folders = [p for p in project_path(root).iterdir() if p.is_dir()] if project_path(root).is_dir() else []
    return sorted((read_record(p) for p in folders), key=lambda r: (r.date, r.folder), reverse=True)


def _entry(record: Record) -> dict:
    return {k: v for k, v in record.to_json().items() if k != "figures"}


def load_index(root: str | Path = "docs/results") -> list[Record]:
    """The records listed in root/index.json (a relative root is the project's), newest first, without their
    figures (read_record has them); empty where there is no index."""
    path = project_path(root) / "index.json"
    if not path.exists():
        return []
    return [Record.from_json({**entry, "figures": {}}, f"{path} ({entry.get('folder')})")
            for entry in json.loads(path.read_text())]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _readme_list(records: list[Record]) -> str:
    lines = [_LIST_START]
    for section in dict.fromkeys(KINDS.values()):
        lines += ["", f"## {section}", "", "| folder | device | question | verdict |", "|---|---|---|---|"]
        lines += [f"| [`{r.folder}`]({r.folder}/) | {r.device} | {_cell(r.question)} | {_cell(r.verdict)} |"
                  for r in records if KINDS[r.kind] == section]
    return "\n".join([*lines, "", _LIST_END])


def generated(root: str | Path = "docs/results") -> dict[Path, str]:
    """The files `write_index` writes (index.json, README.md, every folder's README.md) and their text."""
    root = project_path(root)
    records = build_index(root)
    out = {root / "index.json": json.dumps([_entry(r) for r in records], indent=1, ensure_ascii=False) + "\n"}
    readme = (root / "README.md").read_text() if (root / "README.md").exists() else "# Results\n"
    block = _readme_list(records)
    if _LIST_START in readme:
        pattern = re.escape(_LIST_START) + ".*?" + re.escape(_LIST_END)
        out[root / "README.md"] = re.sub(pattern, lambda _: block, readme, flags=re.S)
    else:
        out[root / "README.md"] = f"{readme.rstrip()}\n\n{block}\n"
    for r in records:
        path = root / r.folder / "README.md"
        out[path] = with_card(path.read_text() if path.exists() else f"# {r.question}\n", r)
    return out


def stale(root: str | Path = "docs/results") -> list[str]:
    """The generated files that differ from what `write_index` would write (empty: the index is up to date)."""
    return [str(path) for path, text in generated(root).items() if not path.exists() or path.read_text() != text]


def write_index(root: str | Path = "docs/results") -> list[Path]:
    """Regenerate index.json, the README list and every README's card from the result.json files; returns the files
    that changed."""
    changed = []
    for path, text in generated(root).items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.records", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="docs/results", help="the records' folder")
    parser.add_argument("--check", action="store_true", help="only list the stale files; exit 1 when any")
    args = parser.parse_args(argv)
    try:
        if args.check:
            out = stale(args.root)
            print("\n".join(f"stale: {p} (run python -m workbench.records)" for p in out) or "index up to date")
            return 1 if out else 0
        for path in write_index(args.root):
            print(f"wrote {path}")
    except (ValueError, FileNotFoundError) as err:
        print(err)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

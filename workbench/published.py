"""The published nightly results a notebook shows beside its smoke run when this machine has no GPU.

A full-scale nightly published to docs/results (`<date>_nightly-<device>_<sha>/`, with `env.json` and the tables
the notebooks wrote) is what the CPU run cannot show: the standard kernels' mismatch at real shapes on a GPU.
`published_nightly` finds the newest such folder holding a given table and labels it with `published_label`, as the
ON/OFF notebook's `onoff.publish.published_results` labels its folders.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .tables import project_path

_NIGHTLY = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})_nightly-(?P<slug>[a-z0-9]+)_(?P<sha>\w+)")


def published_label(device: str, date: str) -> str:
    """"published, GPU, <device>, <date>" (CPU for a CPU's run): what a reader sees beside published numbers."""
    return f"published, {'CPU' if device.upper() == 'CPU' else 'GPU'}, {device}, {date}"


@dataclass(frozen=True)
class PublishedNightly:
    """One published nightly folder and the table asked for, as a notebook shows them."""

    folder: Path
    """The folder in docs/results."""
    table: pd.DataFrame
    """The table asked for (`<name>.csv` in the folder)."""
    figure: Path | None
    """The PNG the notebook drew from that table, as published (None when it was not published)."""
    label: str
    """"published, GPU, <device>, <date>": what a reader must see next to these numbers."""


def published_nightly(name: str, figure: str = "", root: str | Path = "docs/results") -> PublishedNightly | None:
    """The newest published nightly folder under `root` (a relative root is the project's) that has `<name>.csv`,
    with `<figure>.png` where given and present; None when no folder has that table."""
    found = [(m["date"], folder.name, folder, m) for folder in project_path(root).glob("*_nightly-*")
             if (m := _NIGHTLY.fullmatch(folder.name)) and (folder / f"{name}.csv").exists()]
    if not found:
        return None
    _, _, folder, match = max(found, key=lambda f: f[:2])
    env = json.loads((folder / "env.json").read_text()) if (folder / "env.json").exists() else {}
    png = folder / f"{figure}.png"
    return PublishedNightly(folder, pd.read_csv(folder / f"{name}.csv"), png if figure and png.exists() else None,
                            published_label(env.get("gpu") or match["slug"].upper(), match["date"]))

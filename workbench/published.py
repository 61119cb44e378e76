"""The published nightly results a notebook shows beside its smoke run when this machine has no GPU.

A full-scale nightly published to docs/results (a record of kind `nightly`, with the tables the notebooks wrote)
is what the CPU run cannot show: the standard kernels' mismatch at real shapes on a GPU. `published_nightly` finds
the newest such record in the index (`workbench.records`) holding a given table and labels it with
`published_label`, as the ON/OFF notebook's `onoff.publish.published_results` labels its folders.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .records import load_index
from .tables import project_path


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
    """The newest published nightly record in `root`'s index (a relative root is the project's) whose folder has
    `<name>.csv`, with `<figure>.png` where given and present; None when no record has that table."""
    found = [r for r in load_index(root)
             if r.kind == "nightly" and (project_path(root) / r.folder / f"{name}.csv").exists()]
    if not found:
        return None
    record = max(found, key=lambda r: (r.date, r.folder))
    folder = project_path(root) / record.folder
    png = folder / f"{figure}.png"
    return PublishedNightly(folder, pd.read_csv(folder / f"{name}.csv"), png if figure and png.exists() else None,
                            published_label(record.device, record.date))

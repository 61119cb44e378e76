"""Where a run's tables live: `<run_dir>/metrics/<name>.csv`. Notebooks write them, plots and the
nightly summary read them back, so every figure can be redrawn from any run folder."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def project_path(path: str | Path) -> Path:
    """`path` as given when absolute; a relative one against the project root (the checkout holding
    pyproject.toml that this package runs from), else against the working directory. A notebook's kernel starts
    in notebooks/, and its runs/ must be the project's, not notebooks/runs/."""
    path = Path(path)
    root = Path(__file__).resolve().parents[1]
    if path.is_absolute() or not (root / "pyproject.toml").exists():
        return path
    return root / path


def save_table(table: pd.DataFrame, run_dir: str | Path, name: str) -> Path:
    """Write `table` to run_dir/metrics/name.csv; returns the path."""
    path = Path(run_dir) / "metrics" / f"{name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(path, index=False)
    return path


def load_table(source: str | Path, name: str = "on_off") -> pd.DataFrame:
    """A table from a CSV file (also .csv.gz), or from a run folder's metrics/name.csv."""
    path = Path(source)
    if path.is_dir():
        path = path / "metrics" / f"{name}.csv"
    if not path.exists():
        raise FileNotFoundError(f"no table at {path}; point at a run folder holding metrics/{name}.csv "
                                "or at the CSV itself (run notebook 04, or `python -m workbench on-off`, first)")
    return pd.read_csv(path)

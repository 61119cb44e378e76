"""Where a run's tables live: `<run_dir>/metrics/<name>.csv`. Notebooks write them, plots and the
nightly summary read them back, so every figure can be redrawn from any run folder."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


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

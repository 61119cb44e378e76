"""Sweeps: one grid syntax (`field=v1,v2` per axis) over an experiment's config or a notebook's parameters.

- `grid`: parsing and checking a grid, its points in a stable order, a folder name per point, and the marker
  that says a point finished (so a rerun skips it);
- `runner`: `SweepConfig` and `sweep`, every point of a grid run as one experiment (train, on-off) into its own
  folder, resumable, their long tables combined and compared in a figure.

`python -m workbench nightly --grid ...` runs the same grids over the notebooks' parameters (`workbench.nightly`).
"""

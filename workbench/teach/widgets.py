"""Interactive explorers for the notebooks. Without ipywidgets they return a plain table. Headless runs
(the nightly) do not build them: the notebooks' `interactive` parameter picks the plain table there."""

from __future__ import annotations

import pandas as pd

from .. import bf16


def bf16_table(values=(0.1, 1.0, 3.14159, 1000.5, -2.7e-5)) -> pd.DataFrame:
    """For each value: its bf16 rounding, the bits in hex, the bf16 neighbours, the ulp, the rounding error."""
    return pd.DataFrame([bf16.neighbours(float(v)) for v in values])


def bf16_explorer(value: float = 0.1):
    """A number box: type a value, see its bf16 rounding and neighbours (ipywidgets); without
    ipywidgets, the table for `value`."""
    try:
        import ipywidgets
        from IPython.display import display
    except ImportError:
        return bf16_table([value])
    return ipywidgets.interactive(lambda value: display(bf16_table([value])),
                                  value=ipywidgets.FloatText(value=value, description="value"))

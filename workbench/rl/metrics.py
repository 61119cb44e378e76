"""The run's metrics: a long table (step, metric, value, variant, seed), written to metrics.csv and, when
asked, to TensorBoard with the same numbers; and the per-layer grouping of weight-change metrics."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd

COLUMNS = ["step", "metric", "value", "variant", "seed"]


def layer_group(name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'layer_03'; embeddings, final norm and head by name."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"layer_{int(parts[2]):02d}"
    return {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
            "lm_head.weight": "lm_head"}.get(name, name)


def weight_delta_metrics(sq_delta: dict[str, float], sq_before: dict[str, float]) -> dict[str, float]:
    """L2 norm of the update and its size relative to the weights, in total and per layer group, from the
    groups' sums of squares (of the change, and of the weights before it)."""
    out = {"weight_delta_l2": math.sqrt(sum(sq_delta.values())),
           "weight_rel_change": math.sqrt(sum(sq_delta.values()) / max(sum(sq_before.values()), 1e-300))}
    for g in sorted(sq_delta):
        out[f"weight_delta_l2/{g}"] = math.sqrt(sq_delta[g])
        out[f"weight_rel_change/{g}"] = math.sqrt(sq_delta[g] / max(sq_before[g], 1e-300))
    return out


class MetricsLog:
    """The long table being built, and optionally a TensorBoard writer fed the same numbers. With `out` None the
    table stays in memory (the ranks of a data-parallel run other than rank 0, which alone writes files)."""

    def __init__(self, variant: str, seed: int, out: Path | None, tensorboard: bool):
        self.rows: list[dict] = []
        self.variant, self.seed, self.out = variant, seed, out
        self.tensorboard = tensorboard
        self.writer = None
        if tensorboard:
            try:
                import torch.utils.tensorboard  # noqa: F401
            except ImportError:
                raise ValueError("tensorboard=True needs the tensorboard package: pip install tensorboard") from None

    def start(self, first_step: int, previous: pd.DataFrame | None = None) -> None:
        """Take the rows of a resumed run; open TensorBoard, where events of steps >= first_step left by an
        interrupted run are dropped."""
        if previous is not None:
            self.rows.extend(previous.to_dict("records"))
        if self.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out / "tensorboard"), purge_step=first_step)

    def __call__(self, step: int, metric: str, value) -> None:
        value = float(value)
        self.rows.append({"step": step, "metric": metric, "value": value, "variant": self.variant,
                          "seed": self.seed})
        if self.writer is not None:
            self.writer.add_scalar(metric, value, step)

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=COLUMNS)

    def write(self) -> pd.DataFrame:
        """The table, also into out/metrics.csv (where this rank writes files)."""
        table = self.table()
        if self.out is not None:
            tmp = self.out / ".metrics.csv.tmp"
            table.to_csv(tmp, index=False)
            os.replace(tmp, self.out / "metrics.csv")  # a kill while writing keeps the previous table whole
        return table

    def close(self) -> pd.DataFrame:
        if self.writer is not None:
            self.writer.close()
        return self.write()

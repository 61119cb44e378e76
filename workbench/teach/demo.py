"""The first thing to see: does a row of a matmul depend on the batch it is in?

Row 0 of x[:M] @ W.T is computed for several M, by the `standard` path
(cuBLAS, or the CPU BLAS) and by the `invariant` kernel, and compared with the
same row computed alone (M = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from .. import bf16
from ..env import resolve_device
from ..kernels import REGISTRY


@dataclass(frozen=True)
class BatchVarianceConfig:
    k: int = 256
    """Inner dimension of the product (4096 shows the effect on a GPU)."""
    n: int = 256
    """Output features."""
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 7, 8, 16, 32, 64)
    """The M to try; row 0 at M is compared with row 0 at M = 1."""
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    """Operand dtypes to try."""
    device: str = "auto"
    """'cuda', 'cpu', or 'auto' (cuda when there is one)."""
    seed: int = 0
    """Seed of the random operands."""

    def __post_init__(self):
        if self.k < 1 or self.n < 1:
            raise ValueError(f"k and n must be positive, got k={self.k}, n={self.n}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive integers, got {self.batch_sizes}")
        for d in self.dtypes:
            if d not in ("bfloat16", "float32"):
                raise ValueError(f"dtypes may be 'bfloat16' or 'float32', got {d!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")


def batch_variance(cfg: BatchVarianceConfig) -> pd.DataFrame:
    """One row per (dtype, M): how far row 0 at M is from row 0 at M = 1, for both modes."""
    device = resolve_device(cfg.device)
    op = REGISTRY["linear"]
    g = torch.Generator().manual_seed(cfg.seed)
    m_max = max(cfg.batch_sizes)
    x32 = torch.randn(m_max, cfg.k, generator=g)
    w32 = torch.randn(cfg.n, cfg.k, generator=g) / cfg.k**0.5
    rows = []
    for dname in cfg.dtypes:
        dtype = getattr(torch, dname)
        x, w = x32.to(device, dtype), w32.to(device, dtype)
        alone = {"standard": op.standard(x[:1], w), "invariant": op.invariant(x[:1], w)}
        for m in cfg.batch_sizes:
            row = {"dtype": dname, "M": m}
            for mode_name, fn in (("standard", op.standard), ("invariant", op.invariant)):
                r0 = fn(x[:m], w)[:1]
                row[f"{mode_name}_max_abs_diff"] = (r0.float() - alone[mode_name].float()).abs().max().item()
                row[f"{mode_name}_max_ulps"] = int(bf16.ulp_distance(r0, alone[mode_name]).max())
                row[f"{mode_name}_bitwise_equal"] = torch.equal(r0, alone[mode_name])
            rows.append(row)
    return pd.DataFrame(rows)


def format_table(table: pd.DataFrame) -> str:
    """The table for a terminal (< 100 characters wide): per mode, row 0's max |difference| from M = 1, in ulps,
    and whether it is the same bits."""
    short = {"max_abs_diff": "max|d|", "max_ulps": "ulps", "bitwise_equal": "same"}
    view = table[["dtype", "M"]].copy()
    for mode_name, tag in (("standard", "std"), ("invariant", "inv")):
        for col, name in short.items():
            v = table[f"{mode_name}_{col}"]
            view[f"{tag} {name}"] = v.map(lambda x: f"{x:.2g}") if col == "max_abs_diff" else v
    return view.to_string(index=False)


def summarize(table: pd.DataFrame) -> str:
    lines = []
    for mode_name in ("standard", "invariant"):
        for dname, part in table.groupby("dtype", sort=False):
            bad = part.loc[~part[f"{mode_name}_bitwise_equal"], "M"].tolist()
            verdict = "identical at every M" if not bad else f"differs at M = {bad}"
            lines.append(f"{mode_name:>9} {dname:>8}: row 0 {verdict}")
    return "\n".join(lines)

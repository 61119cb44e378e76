"""What the step's stages read of a trainer rank, as a type: `run.TrainerRank` is its one implementation. Named
here so that the stages (`step.py`, `scoring.py`), which `run.py` chooses and builds once at setup, need not import
the module that builds them: the import graph stays a tree."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from ..distributed.data_parallel import DataParallel
from ..distributed.pipeline import Pipeline
from .config import TrainConfig
from .metrics import MetricsLog
from .weights import TrainWeights


class Rank(Protocol):
    """A trainer rank set up for the step (`run.TrainerRank`)."""

    cfg: TrainConfig
    out: Path
    device: str
    tok: object
    dp: DataParallel
    pipeline: Pipeline | None
    tp_mesh: object | None
    log: MetricsLog
    weights: TrainWeights
    reference: object | None
    sampler: object
    """`samplers.Embedded`, `VLLM` or `Remote`."""
    scoring: object
    """`scoring.ScorePass`, `InUpdate` or `Received`."""
    rewards: object
    """`rewards.RewardStage`."""

"""The RL side: the GRPO-family losses and their pieces, and the tasks (the trainer loop comes next)."""

from .losses import (
    AGGREGATIONS,
    LOSSES,
    LossConfig,
    LossSpec,
    aggregate,
    get_loss,
    group_advantages,
    importance_weights,
    kl_estimate,
)
from .tasks import GSM8K, Arithmetic, Problem, extract_answer, normalize_number

__all__ = [
    "AGGREGATIONS",
    "GSM8K",
    "LOSSES",
    "Arithmetic",
    "LossConfig",
    "LossSpec",
    "Problem",
    "aggregate",
    "extract_answer",
    "get_loss",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
    "normalize_number",
]

"""The RL side: the GRPO-family losses and their pieces, the tasks, and the trainer (`trainer.train`, its
config in `config.py`, one step's pieces in rollout / logprobs / update / weights / sync / checkpoint /
metrics)."""

from .answers import extract_answer, lenient_correct, normalize_number
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
from .tasks import GSM8K, Arithmetic, Problem

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
    "lenient_correct",
    "normalize_number",
]

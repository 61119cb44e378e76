"""The RL trainer: `trainer.train` runs it, its config in `config.py`. A run is set up in `run.py` (a trainer rank,
and a rollout rank where roles are split); one step (`step.py`) samples through a `Sampler` chosen once at setup
(`samplers.py`: embedded, vLLM, or a remote rollout rank), scores through a `Scoring` strategy (`scoring.py`: before
the update, or inside it), and updates; its pieces are in rollout / logprobs / update / weights / sync / checkpoint /
metrics, the GRPO-family losses and their pieces in `losses.py`. The tasks it trains on are in `workbench.tasks`,
its starting policies in `workbench.policies`."""

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

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "LossConfig",
    "LossSpec",
    "aggregate",
    "get_loss",
    "group_advantages",
    "importance_weights",
    "kl_estimate",
]

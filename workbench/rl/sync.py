"""Weight sync: the generator gets the weights it samples with, checked by checksum.

`shared`: the generator runs the trainer's bf16 model itself. `copy`: its own bf16 model, copied into in
place (and into a running vLLM engine). `checkpoint`: through disk, as across processes. With
`policy_lag=1` the generator keeps the weights of one update before the trainer's (an asynchronous
pipeline's lag, reproduced exactly; the steps still run one after another).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models import build, copy_weights, load_pretrained, save_pretrained, weights_checksum
from .config import TrainConfig


class WeightSync:
    def __init__(self, cfg: TrainConfig, model, out: Path, device: str, engine=None,
                 lagged: tuple[int, dict] | None = None):
        self.cfg, self.model, self.out, self.device, self.engine = cfg, model, out, device, engine
        self.generator = model if cfg.sync == "shared" else build(model.config, device=device,
                                                                  dtype=torch.bfloat16, seed=None)
        self.version = 0
        self.history: list[tuple[int, dict]] = [lagged] if lagged is not None else []
        """(version, bf16 weights) the trainer published, oldest first (policy lag only)."""

    @property
    def lagged(self) -> tuple[int, dict] | None:
        """The generator's weights when they are not the trainer's (what a checkpoint must keep)."""
        return self.history[0] if self.cfg.policy_lag and self.history else None

    def __call__(self, version: int) -> None:
        """Publish the trainer's weights after `version` updates; the generator moves to the version it samples
        the next step with."""
        cfg = self.cfg
        self.version = version
        if cfg.sync == "shared":
            return
        current = dict(self.model.state_dict())
        source = current
        if cfg.policy_lag:
            self.history.append((version, {k: v.detach().clone() for k, v in current.items()}))
            del self.history[: -(cfg.policy_lag + 1)]
            self.version, source = self.history[0]
        if cfg.sync == "copy":
            copy_weights(source, self.generator)
            if self.engine is not None:
                self.engine.load_weights(source)
        else:
            save_pretrained(self.model, self.out / "sync")
            self.generator = load_pretrained(self.out / "sync", dtype=torch.bfloat16, device=self.device)
            if self.engine is not None:
                self.engine.load_checkpoint(self.out / "sync")
        synced = {"generator": weights_checksum(self.generator.state_dict()) == weights_checksum(source)}
        if self.engine is not None:
            synced["vLLM engine"] = self.engine.weights_checksum() == self.engine.expected_checksum(source)
        for who, ok in synced.items():
            if not ok:
                raise RuntimeError(f"the {who}'s weights differ from the trainer's version {self.version} after "
                                   f"the sync ({cfg.sync}); the sync path is broken")

"""Weight sync: the generator gets the weights it samples with, checked by checksum.

`shared`: the generator runs the trainer's bf16 model itself. `copy`: its own bf16 model, copied into in
place (and into a running vLLM engine). `checkpoint`: through disk, as across processes. With
`policy_lag=k` the generator keeps the weights of k updates before the trainer's (an asynchronous
pipeline's bounded policy age, reproduced exactly; the steps still run one after another): the trainer keeps the
last k + 1 published versions, and a checkpoint the k it cannot rebuild.

With LoRA (adapter='lora') only the adapters move: the generator gets the frozen base once, at the start
(checked bitwise then), and each sync copies the adapters in place (`copy`) or through a PEFT folder
(`checkpoint`); it runs them unmerged, as the trainer does. `moved_bytes` is what the last sync moved.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..generation.fp8 import Fp8Sampler
from ..models import build, copy_weights, load_pretrained, save_pretrained, weights_equal
from ..models.lora import adapter_flat, adapter_state, attach, base_state, copy_adapters
from ..models.peft import load_adapter, save_adapter
from .config import TrainConfig


class WeightSync:
    def __init__(self, cfg: TrainConfig, model, out: Path, device: str, engine=None,
                 lagged: list[tuple[int, dict]] | None = None):
        self.cfg, self.model, self.out, self.device, self.engine = cfg, model, out, device, engine
        self.lora = cfg.optim.lora_config()
        self.generator = model if cfg.rollout.sync == "shared" else build(model.config, device=device,
                                                                  dtype=torch.bfloat16, seed=None)
        if self.lora is not None and cfg.rollout.sync != "shared":
            base = base_state(model)
            copy_weights(base, self.generator)
            attach(self.generator, self.lora)
            if not weights_equal(base_state(self.generator), base):
                raise RuntimeError("the generator's frozen base differs from the trainer's after its copy")
        self.fp8: Fp8Sampler | None = None
        """sampler_precision='fp8': the generator's fp8 copy, refreshed from it at every sync."""
        self.version = 0
        self.moved_bytes = 0
        self.history: list[tuple[int, dict]] = list(lagged or [])
        """(version, bf16 weights) the trainer published, oldest first (policy lag only)."""

    @property
    def lagged(self) -> list[tuple[int, dict]] | None:
        """The published versions older than the trainer's own, oldest (the generator's) first: what a checkpoint
        must keep (None without a policy lag)."""
        return self.history[:-1] if self.cfg.rollout.policy_lag and self.history else None

    def weights_of(self, version: int) -> dict:
        """The published weights of `version` (policy lag: the last k + 1 are kept)."""
        for v, w in self.history:
            if v == version:
                return w
        raise RuntimeError(f"weights version {version} is not among the kept ones {[v for v, _ in self.history]}: "
                           "the policy-lag bookkeeping is broken")

    def _trained(self, model) -> dict[str, torch.Tensor]:
        """The weights a sync moves: the whole model, or (LoRA) the adapters."""
        if self.lora is None:
            return dict(model.state_dict())
        return {k: v.detach() for k, v in adapter_state(model).items()}

    def _copy_flat_adapters(self) -> bool:
        """LoRA, sync='copy', no lag: the adapters as the one flat buffer both models hold them in (`attach`'s
        layout, the same for the same config): one copy and one bitwise comparison on the device, a few tens of
        microseconds of launches where a copy per adapter cost milliseconds of host time. False where either
        model's adapters are not in such a buffer (the general path then runs)."""
        rollout = self.cfg.rollout
        if self.lora is None or rollout.sync != "copy" or rollout.policy_lag or self.engine is not None:
            return False
        src, dst = adapter_flat(self.model), adapter_flat(self.generator)
        if src is None or dst is None or src.shape != dst.shape or src.dtype != dst.dtype:
            return False
        self.moved_bytes = src.nbytes
        dst.copy_(src)
        # Bytes, not values: -0.0 == 0.0 and NaN != NaN as numbers, not as bits.
        if not torch.equal(dst.view(torch.uint8), src.view(torch.uint8)):
            raise RuntimeError(f"the generator's adapters differ from the trainer's version {self.version} after "
                               "the sync (copy); the sync path is broken")
        return True

    @property
    def sampler(self):
        """The model the embedded generator samples with: the generator, or its fp8 copy (sampler_precision)."""
        return self.generator if self.fp8 is None else self.fp8.model

    def __call__(self, version: int) -> None:
        """Publish the trainer's weights after `version` updates; the generator (and its fp8 copy) moves to the
        version it samples the next step with."""
        self._publish(version)
        if self.cfg.rollout.sampler_precision == "fp8":
            if self.fp8 is None:
                self.fp8 = Fp8Sampler(self.generator)
            else:
                self.fp8.load(self.generator)

    def _publish(self, version: int) -> None:
        cfg = self.cfg
        self.version = version
        if cfg.rollout.sync == "shared" or self._copy_flat_adapters():
            return
        current = self._trained(self.model)
        source = current
        if cfg.rollout.policy_lag:
            self.history.append((version, {k: v.detach().clone() for k, v in current.items()}))
            del self.history[: -(cfg.rollout.policy_lag + 1)]
            self.version, source = self.history[0]
        self.moved_bytes = sum(v.numel() * v.element_size() for v in source.values())
        if cfg.rollout.sync == "copy":
            (copy_weights if self.lora is None else copy_adapters)(source, self.generator)
            if self.engine is not None:
                self.engine.load_weights(source)
        elif self.lora is not None:
            load_adapter(save_adapter(self.out / "sync", self.lora, source), self.generator)
        else:
            save_pretrained(self.model, self.out / "sync")
            self.generator = load_pretrained(self.out / "sync", dtype=torch.bfloat16, device=self.device)
            if self.engine is not None:
                self.engine.load_checkpoint(self.out / "sync")
        synced = {"generator": weights_equal(self._trained(self.generator), source)}
        if self.engine is not None:
            synced["vLLM engine"] = self.engine.weights_checksum() == self.engine.expected_checksum(source)
        for who, ok in synced.items():
            if not ok:
                raise RuntimeError(f"the {who}'s weights differ from the trainer's version {self.version} after "
                                   f"the sync ({cfg.rollout.sync}); the sync path is broken")

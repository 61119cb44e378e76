"""The arms of the ON/OFF experiment: named variants of one run config, each changing only where the
generator's log-probs come from and what the update does with them.

`on`: generator and trainer bitwise equal. The `off` arms run an engine's kernels (`sampler_kernels='engine'`: decode
shapes, and RMSNorm, SiLU x up and RoPE fused and rounded once, as vLLM's) beside a standard trainer with Hugging
Face's formulas; `off-recompute`, `off-tis` and `off-mis` change only the update (old log-probs recomputed, truncated
or masked importance sampling); `off-fp8` samples W8A8; `off-shapes` changes only the shapes; `off-vllm` / `on-vllm`
generate with vLLM; `noise=S` perturbs the logits by a seeded amount (the dose-response knob). The table of arms, and
why an engine's kernels are modelled so: docs/onoff.md, "`workbench/onoff/arms.py`: the arms, and what an engine's
kernels model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CORRECTION_CAP = 2.0
"""The cap C of the corrections (the common default: verl, slime, TRL's vllm_importance_sampling_cap)."""


@dataclass(frozen=True)
class Arm:
    description: str
    """One line for tables and legends."""
    kernel_mode: str
    old_logprobs: str
    correction: str = "none"
    """'none', 'tis' or 'mask' (the level follows the loss: per token, or per sequence for GSPO and blog)."""
    generator: str = "embedded"
    vllm_model: str = "workbench"
    sampler_noise: float = 0.0
    sampler_kernels: str = "trainer"
    """'trainer' or 'engine' (TrainConfig.rollout.sampler_kernels)."""
    sampler_precision: str = "bf16"
    """'bf16' or 'fp8' (TrainConfig.rollout.sampler_precision)."""


_ENGINE = {"sampler_kernels": "engine"}
ARMS: dict[str, Arm] = {
    "on": Arm("bitwise generator = trainer (invariant kernels)", "invariant", "sampler"),
    "off": Arm("an engine's kernels generating, standard trainer, old log-probs = the sampler's", "standard",
               "sampler", **_ENGINE),
    "off-recompute": Arm("an engine's kernels, old log-probs recomputed by the trainer", "standard", "recompute",
                         **_ENGINE),
    "off-tis": Arm("an engine's kernels, truncated importance sampling (C = 2)", "standard", "recompute", "tis",
                   **_ENGINE),
    "off-mis": Arm("an engine's kernels, masked importance sampling ([1/2, 2])", "standard", "recompute", "mask",
                   **_ENGINE),
    "off-fp8": Arm("an engine's kernels with W8A8 fp8 products (vLLM's default fp8), bf16 trainer, old log-probs = "
                   "the sampler's", "standard", "sampler", sampler_precision="fp8", **_ENGINE),
    "off-shapes": Arm("standard kernels on both sides (only the shapes differ), old log-probs = the sampler's",
                      "standard", "sampler"),
    "off-vllm": Arm("vLLM's own model and default kernels generating, standard trainer", "standard", "sampler",
                    generator="vllm", vllm_model="vllm"),
    "on-vllm": Arm("vLLM running the workbench model, invariant", "invariant", "sampler", generator="vllm"),
}
NOISE_PREFIX = "noise="


def get_arm(name: str) -> Arm:
    """The arm `name`: one of ARMS, or 'noise=S' (S > 0) for the dose-response."""
    if name in ARMS:
        return ARMS[name]
    if name.startswith(NOISE_PREFIX):
        try:
            sigma = float(name[len(NOISE_PREFIX):])
        except ValueError:
            sigma = float("nan")
        if not (math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"arm {name!r}: the noise level after '{NOISE_PREFIX}' must be a number > 0")
        return Arm(f"invariant, sampler logits + {sigma:g} x N(0, 1)", "invariant", "sampler", sampler_noise=sigma)
    raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARMS)} or {NOISE_PREFIX}<sigma>")


ARM_FIELDS = ("variant", "kernel_mode", "old_logprobs", "sampler_noise", "generator", "vllm_model", "sampler_kernels",
              "sampler_precision", "correction", "correction_cap")
"""The TrainConfig fields every arm sets (`arm_settings`)."""


def arm_settings(name: str, sequence_level: bool) -> dict:
    """The TrainConfig fields arm `name` sets (`sequence_level`: the loss has one ratio per sequence)."""
    arm = get_arm(name)
    settings = {"variant": name, "kernel_mode": arm.kernel_mode, "old_logprobs": arm.old_logprobs,
                "sampler_noise": arm.sampler_noise, "generator": arm.generator, "vllm_model": arm.vllm_model,
                "sampler_kernels": arm.sampler_kernels, "sampler_precision": arm.sampler_precision,
                "correction": "none", "correction_cap": CORRECTION_CAP}
    if arm.correction != "none":
        settings["correction"] = f"{arm.correction}-{'sequence' if sequence_level else 'token'}"
    if arm.generator == "vllm":
        settings["sync"] = "copy"  # vLLM holds its own weights: updated in place each step
    return settings

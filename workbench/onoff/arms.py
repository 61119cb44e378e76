"""The arms of the ON/OFF experiment: named variants of one run config, each changing only where the
generator's log-probs come from and what the update does with them.

| arm | generator | trainer | PPO ratio's old log-probs | correction |
|---|---|---|---|---|
| `on` | embedded, invariant kernels | invariant | the sampler's (the same bits as the trainer's) | none |
| `off` | embedded, standard kernels | standard | the sampler's (the blog's OFF) | none |
| `off-recompute` | standard | standard | the trainer's recomputation | none |
| `off-tis` | standard | standard | recomputed | truncated IS, w = min(pi_old / mu, 2) |
| `off-mis` | standard | standard | recomputed | masked IS, w = 1 inside [1/2, 2], else 0 |
| `off-vllm` | vLLM, its own model and default kernels | standard | the sampler's (the blog's exact OFF) | none |
| `on-vllm` | vLLM running the workbench model, invariant | invariant | the sampler's | none |
| `noise=S` | embedded, invariant, logits + S x N(0, 1) | invariant | the sampler's | none |

`off` puts the mismatch into the ratio (and its clipping) as trainers that take the old log-probs from the
sampler do; `off-recompute` keeps it out of the ratio and leaves it only in which tokens were sampled;
the corrections reweigh tokens (or sequences, for a sequence-level loss) by pi_old / mu. `noise=S` is the
dose-response knob: the kernels stay bitwise, and a seeded perturbation of known size makes the sampler
another policy, so its mismatch is measured (KL per step) like the kernels'.
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


ARMS: dict[str, Arm] = {
    "on": Arm("bitwise generator = trainer (invariant kernels)", "invariant", "sampler"),
    "off": Arm("standard kernels, old log-probs = the sampler's", "standard", "sampler"),
    "off-recompute": Arm("standard kernels, old log-probs recomputed by the trainer", "standard", "recompute"),
    "off-tis": Arm("standard kernels, truncated importance sampling (C = 2)", "standard", "recompute", "tis"),
    "off-mis": Arm("standard kernels, masked importance sampling ([1/2, 2])", "standard", "recompute", "mask"),
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


def arm_settings(name: str, sequence_level: bool) -> dict:
    """The TrainConfig fields arm `name` sets (`sequence_level`: the loss has one ratio per sequence)."""
    arm = get_arm(name)
    settings = {"variant": name, "kernel_mode": arm.kernel_mode, "old_logprobs": arm.old_logprobs,
                "sampler_noise": arm.sampler_noise, "generator": arm.generator, "vllm_model": arm.vllm_model,
                "correction": "none", "correction_cap": CORRECTION_CAP}
    if arm.correction != "none":
        settings["correction"] = f"{arm.correction}-{'sequence' if sequence_level else 'token'}"
    if arm.generator == "vllm":
        settings["sync"] = "copy"  # vLLM holds its own weights: updated in place each step
    return settings

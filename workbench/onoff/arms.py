"""The arms of the ON/OFF experiment: named variants of one run config, each changing only where the
generator's log-probs come from and what the update does with them.

| arm | generator | trainer | PPO ratio's old log-probs | correction |
|---|---|---|---|---|
| `on` | embedded, invariant kernels | invariant | the sampler's (the same bits as the trainer's) | none |
| `off` | embedded, an engine's kernels | standard | the sampler's (the blog's OFF) | none |
| `off-recompute` | an engine's | standard | the trainer's recomputation | none |
| `off-tis` | an engine's | standard | recomputed | truncated IS, w = min(pi_old / mu, 2) |
| `off-mis` | an engine's | standard | recomputed | masked IS, w = 1 inside [1/2, 2], else 0 |
| `off-fp8` | an engine's, its products W8A8 fp8 (vLLM's default fp8) | standard (bf16) | the sampler's | none |
| `off-shapes` | embedded, standard kernels | standard | the sampler's | none |
| `off-vllm` | vLLM, its own model and default kernels | standard | the sampler's (the blog's exact OFF) | none |
| `on-vllm` | vLLM running the workbench model, invariant | invariant | the sampler's | none |
| `noise=S` | embedded, invariant, logits + S x N(0, 1) | invariant | the sampler's | none |

What an engine's kernels model (`sampler_kernels='engine'`). A production engine (vLLM, SGLang) and a training
framework differ in two ways, and the `off` arms have both:
- the shapes: the engine's products and attention run decode-shaped (one token per sequence against its cache),
  the trainer's prefill-shaped, so cuBLAS and FlashAttention pick other tiles and splits. Alone (`off-shapes`)
  this depends on the shapes and on the decode path: with few, short sequences both sides can sum in nearly the
  same order, so at small presets this alone can be far below an engine's mismatch
  (docs/results/2026-11-27_offarm-probe-h100_8217c92).
- the formulas: the engine fuses RMSNorm, SiLU x up and RoPE into kernels that compute in fp32 and round once
  (vLLM's `fused_add_rms_norm`, `silu_and_mul`, `rotary_embedding`), where the trainer runs Hugging Face's
  (TRL's, most trainers') formulas with their bf16 round trips and bf16 cos/sin. That difference is in every
  element at every shape, so the arm mismatches on every preset. Both sides keep bf16 logits and an fp32
  log-softmax of them, as vLLM computes its sampler's log-probs.
`off-shapes` (the `off` of results before 2026-11-27) is kept to show what shapes alone do.

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

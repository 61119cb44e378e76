"""The groups of `TrainConfig`'s settings: what the generator samples (`rollout`), what the update minimises
(`objective`), how it optimises (`optim`), where the ranks go (`distributed`), when the run checkpoints and stops
(`checkpoint`), and what it trains on (`data`).

A setting keeps its name in its group (`TrainConfig(lr=1e-3)`, `lr=1e-3` on the command line or in a file, and
`optim.lr`), and code reads it by its path (`cfg.optim.lr`). A check that concerns one group's settings alone is
the group's; one across groups stays in `TrainConfig.__post_init__`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..config import check_at_least_one, check_choices, check_non_negative
from ..models.config import RECOMPUTE
from ..models.lora import PROJECTIONS, LoraConfig
from ..tasks import TASKS
from .losses import AGGREGATIONS, KL_ESTIMATORS, get_loss


def _check_int(name: str, value, low: int, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low} ({meaning}), got {value!r}")


@dataclass(frozen=True)
class RolloutConfig:
    generator: Literal["embedded", "vllm"] = "embedded"
    """'embedded' (the workbench's sampler) or 'vllm' (vLLM running the workbench model: needs vLLM, a GPU)."""
    vllm_model: Literal["workbench", "vllm"] = "workbench"
    """generator='vllm': 'workbench' (vLLM runs the workbench model and kernels) or 'vllm' (vLLM's own model
    implementation and kernels: default kernels in standard mode, its batch-invariant ones in invariant mode)."""
    vllm_memory: float = 0.3
    """generator='vllm': the share of the GPU's memory vLLM may take."""
    keep_graphs: bool = True
    """generator='embedded': keep its KV caches and CUDA graphs from one step's rollouts to the next (captured once,
    not every step; the same bits in invariant mode); that memory stays held through the update: False where memory
    is short. No effect with sync='checkpoint' (a new generator model every step)."""
    sampler_kernels: Literal["trainer", "engine"] = "trainer"
    """The embedded generator's kernels: 'trainer' (the trainer's kernel mode) or 'engine' (with
    kernel_mode='standard': an inference engine's fast path, the norms, SiLU and RoPE fused and rounded once as
    vLLM's kernels do, against the trainer's Hugging Face formulas; see docs/onoff.md)."""
    sampler_precision: Literal["bf16", "fp8"] = "bf16"
    """The embedded generator's decoder products: 'bf16', or 'fp8' (W8A8 as vLLM's default fp8; with
    sampler_kernels='engine'; generation/fp8.py)."""
    sampler_noise: float = 0.0
    """Std of seeded Gaussian noise the generator adds to its logits before sampling: a sampler-trainer mismatch
    of controlled size, measured each step like the kernels' (dose-response experiments; 0: none)."""
    prompts_per_step: int = 2
    """Prompts sampled per step (under torchrun: shared among the ranks, a multiple of the world size)."""
    group_size: int = 4
    """Completions per prompt."""
    max_new_tokens: int = 4
    """Completion length limit."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    sync: Literal["shared", "copy", "checkpoint"] = "shared"
    """Weight sync into the generator: shared (same bf16 model), copy, or checkpoint (through disk)."""
    policy_lag: int = 0
    """0: synchronous; k > 0: the generator samples with the weights k updates behind (needs sync='copy'; the trainer
    keeps the last k + 1 versions in bf16)."""

    def __post_init__(self):
        check_choices(self)
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2 (GRPO compares samples of one prompt), "
                             f"got {self.group_size}")
        check_non_negative(self, "sampler_noise")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for RL sampling, got {self.temperature!r}")
        check_at_least_one(self, "prompts_per_step", "max_new_tokens")
        _check_int("policy_lag", self.policy_lag, 0, "0: synchronous; k: k updates behind")
        if self.policy_lag and self.sync != "copy":
            raise ValueError(f"policy_lag={self.policy_lag} keeps the generator's weights apart from the trainer's: "
                             "use sync='copy'")
        if self.generator == "vllm" and self.sync == "shared":
            raise ValueError("generator='vllm' holds its own copy of the weights: use sync='copy' (in place into "
                             "the running engine) or sync='checkpoint' (through disk)")
        if self.generator == "vllm" and self.sampler_noise:
            raise ValueError("sampler_noise perturbs the embedded generator's logits; vLLM's sampler has no such "
                             "knob: use generator='embedded'")
        if not 0 < self.vllm_memory < 1:
            raise ValueError(f"vllm_memory must lie in (0, 1), got {self.vllm_memory!r}")


@dataclass(frozen=True)
class ObjectiveConfig:
    loss: str = "grpo"
    """grpo, dr_grpo, dapo, gspo or blog."""
    clip_low: float = 0.0
    """The PPO ratio is clipped below at 1 - clip_low (0: the loss's published value, 0.2; gspo's 3e-4)."""
    clip_high: float = 0.0
    """The PPO ratio is clipped above at 1 + clip_high (0: the loss's published value; dapo's clip-higher 0.28)."""
    aggregation: str = ""
    """grpo, dr_grpo, dapo: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm (empty: the loss's own)."""
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """The PPO ratio's old policy: 'recompute' (the trainer's forward on the sampling weights) or 'sampler'
    (the generator's own log-probs, as vLLM-based trainers use them)."""
    correction: Literal["none", "tis-token", "tis-sequence", "mask-token", "mask-sequence"] = "none"
    """Off-policy correction: none, tis-token, tis-sequence, mask-token, mask-sequence."""
    correction_cap: float = 2.0
    """Cap C of the correction (truncate at C, or mask outside [1/C, C])."""
    kl_coef: float = 0.0
    """Weight of the KL penalty (0: none, and no reference model is built)."""
    kl_to: Literal["reference", "sampler"] = "reference"
    """What the KL is measured to: 'reference' (the frozen starting policy) or 'sampler' (the generator)."""
    kl_estimator: str = "auto"
    """k1, k2, k3 or 'auto' (k3 in the reward, k2 in the loss); k1 only in the reward (see losses.kl_estimate)."""
    kl_in_reward: bool = False
    """Penalise the KL in the advantages (after the task rewards' scaling: see group_advantages), not in the loss."""

    def __post_init__(self):
        check_choices(self)
        spec = get_loss(self.loss)
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must lie in [0, 1) (0: the loss's published value), got {self.clip_low!r}")
        if not (math.isfinite(self.clip_high) and self.clip_high >= 0):
            raise ValueError(f"clip_high must be a finite number >= 0 (0: the loss's published value), got "
                             f"{self.clip_high!r}")
        if self.aggregation and self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; choose one of {', '.join(AGGREGATIONS)}, "
                             "or leave it empty for the loss's own")
        if self.aggregation and spec.sequence_level:
            raise ValueError(f"loss {self.loss!r} averages one term per sequence and takes no aggregation (it would "
                             "be ignored): leave aggregation empty, or use grpo, dr_grpo or dapo")
        if self.old_logprobs == "sampler" and self.correction != "none":
            raise ValueError(f"correction {self.correction!r} weighs the trainer's old policy against the sampler; "
                             "with old_logprobs='sampler' they are one policy and the weight is 1: "
                             "use old_logprobs='recompute' or correction='none'")
        if spec.sequence_level and self.correction.endswith("-token"):
            raise ValueError(f"loss {self.loss!r} has one ratio per sequence: a per-token correction "
                             f"({self.correction}) has no place in it; use tis-sequence or mask-sequence")
        check_non_negative(self, "kl_coef")
        if self.kl_estimator not in ("auto", *KL_ESTIMATORS):
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}; choose auto, k1, k2 or k3")
        if self.kl_estimator == "k1" and self.kl_coef > 0 and not self.kl_in_reward:
            raise ValueError("kl_estimator='k1' in the loss has a gradient of expectation 0 (it penalises nothing): "
                             "use k2 (or auto) in the loss, or kl_in_reward=True")

    @property
    def kl_estimator_used(self) -> str:
        """The KL estimator the run uses: kl_estimator, or with 'auto' k3 in the reward and k2 in the loss."""
        if self.kl_estimator != "auto":
            return self.kl_estimator
        return "k3" if self.kl_in_reward else "k2"


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    """AdamW learning rate (0 freezes the policy: the frozen-policy probe measures what numerics alone spend)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    max_grad_norm: float = 0.0
    """Scale the gradient down to this global norm when it is larger (0: no clipping)."""
    master_dtype: Literal["float32", "bfloat16"] = "float32"
    """'float32': AdamW on fp32 master weights, cast to bf16 once per update; 'bfloat16': AdamW on the bf16
    weights themselves (no masters; bf16 optimizer state and gradient accumulation)."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the step's sequences are cut into this many mini-batches (PPO)."""
    epochs: int = 1
    """Passes over the step's sequences (each pass reshuffled into mini-batches)."""
    max_tokens_per_microbatch: int = 16384
    """Tokens per forward/backward: real tokens for the workbench's model (sequences packed end to end), padded ones
    for torchtitan's routed model; length-sorted sequences are cut into micro-batches under it."""
    packed_sequences: bool = True
    """The update's micro-batches hold their sequences end to end, no padding (the workbench's model; the same
    log-prob bits, the weight gradients summed in another grouping); False: right-padded, as torchtitan's routed
    model runs them, so that the two trainer backends give the same bits."""
    activation_checkpointing: str = "none"
    """What the backward recomputes instead of keeping: 'none', 'mlp' (each MLP's products: half the activations,
    ~15% more compute) or 'layers' (each decoder layer from its input: ~1/3 more); the same gradient bits."""
    adapter: Literal["none", "lora"] = "none"
    """'none' (train every weight) or 'lora' (freeze the base, train LoRA adapters: see docs/lora.md)."""
    lora_rank: int = 16
    """adapter='lora': the adapters' rank r."""
    lora_alpha: float = 32.0
    """adapter='lora': the adapters' output is scaled by lora_alpha / lora_rank."""
    lora_targets: tuple[str, ...] = PROJECTIONS
    """adapter='lora': the projections with adapters (of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)."""

    def __post_init__(self):
        check_choices(self)
        check_non_negative(self, "lr", "weight_decay", "max_grad_norm")
        check_at_least_one(self, "mini_batches", "epochs", "max_tokens_per_microbatch")
        if self.activation_checkpointing not in RECOMPUTE:
            raise ValueError(f"activation_checkpointing must be one of {', '.join(RECOMPUTE)} (true/false were "
                             f"renamed 'layers'/'none'), got {self.activation_checkpointing!r}")
        LoraConfig(self.lora_rank, self.lora_alpha, self.lora_targets)  # names a bad lora_* field, even unused

    def lora_config(self) -> LoraConfig | None:
        """The adapters' settings (adapter='lora'), or None (full fine-tuning)."""
        if self.adapter != "lora":
            return None
        return LoraConfig(self.lora_rank, self.lora_alpha, self.lora_targets)


@dataclass(frozen=True)
class DistributedConfig:
    rollout_ranks: int = 0
    """Under torchrun: the last this-many ranks only generate, the others only train (0: every rank does both)."""
    parallel: Literal["replicate", "fsdp2"] = "replicate"
    """Trainer ranks under torchrun: 'replicate' (each holds all fp32 masters and AdamW state) or 'fsdp2' (sharded)."""
    trainer_backend: Literal["workbench", "torchtitan"] = "workbench"
    """The update's forward, backward and optimizer step: 'workbench' (its own) or 'torchtitan' (torchtitan's model,
    optimizer and LR-scheduler builders and FSDP2 recipe, on the workbench's kernels: workbench/rl/titan_backend.py)."""
    tensor_parallel: int = 1
    """Under torchrun, trainer_backend='torchtitan': ranks that split each trainer's products (world = dp x this)."""

    def __post_init__(self):
        check_choices(self)
        if self.rollout_ranks < 0:
            raise ValueError(f"rollout_ranks must be an integer >= 0 (0: every rank generates and trains), got "
                             f"{self.rollout_ranks!r}")
        _check_int("tensor_parallel", self.tensor_parallel, 1, "1: none")
        if self.tensor_parallel > 1 and self.trainer_backend != "torchtitan":
            raise ValueError(f"tensor_parallel={self.tensor_parallel} shards torchtitan's model: set "
                             "trainer_backend='torchtitan', or tensor_parallel=1")


@dataclass(frozen=True)
class CheckpointConfig:
    checkpoint_every: int = 5
    """Write a resumable checkpoint every this many steps (and at the end)."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir."""
    time_limit_s: float = 0.0
    """Stop after the step during which this many seconds have passed, with a checkpoint; resume=True goes on
    (for machines that allow a few minutes per command; 0: no limit)."""

    def __post_init__(self):
        check_at_least_one(self, "checkpoint_every")
        check_non_negative(self, "time_limit_s")


@dataclass(frozen=True)
class DataConfig:
    task: str = "arithmetic"
    """'arithmetic' or 'arithmetic-chat' (synthetic), 'counting' (a long checked chain sized to max_new_tokens),
    'facts' (the blog's five), 'gsm8k', or 'humaneval' / 'humaneval-partial' (code run in the sandbox: every test
    passed, or the share passed)."""
    task_source: str = ""
    """GSM8K only: a folder of train/test .jsonl or .parquet, a file, or a hub id (openai/gsm8k, needs the network);
    empty: the folder $WORKBENCH_GSM8K names, where set."""
    question_field: str = "question"
    """GSM8K only: the data's column holding the question (for your own question/answer files)."""
    answer_field: str = "answer"
    """GSM8K only: the data's column holding the answer ('... #### 42', or just the number)."""
    difficulty: int = 1
    """Arithmetic difficulty."""

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        check_at_least_one(self, "difficulty")

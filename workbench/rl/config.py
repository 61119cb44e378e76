"""`TrainConfig`: every setting of a GRPO-family run, shared by `python -m workbench train`, the
experiments and the notebooks' parameter cells. Its settings come in groups (rollout, objective, optim,
distributed, checkpoint, data: workbench/rl/groups.py), each setting still named by its bare name (`lr=1e-3`) or
its path (`optim.lr`). Checks across groups live here, so a bad combination is refused before anything runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..config import check_at_least_one, check_choices, flat_names
from .groups import CheckpointConfig, DataConfig, DistributedConfig, ObjectiveConfig, OptimConfig, RolloutConfig
from .losses import LossConfig, get_loss


@flat_names
@dataclass(frozen=True)
class TrainConfig:
    policy: str = ""
    """Starting policy: registry name (smollm2-135m-instruct), folder, .gguf or hub id; empty: self-trained."""
    chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template (instruct models), where it has one."""
    out_dir: str = "runs/train"
    """Where metrics and checkpoints go."""
    kernel_mode: Literal["invariant", "standard"] = "invariant"
    """'invariant' (bitwise generator = trainer) or 'standard' (the mismatched control)."""
    steps: int = 2
    """Policy updates (the defaults are a CPU smoke run of about 45 s)."""
    seed: int = 0
    """Seed of the data order, the sampling and the starting policy."""
    variant: str = ""
    """This run's name in the metrics' variant column (an experiment's arm); empty: the kernel mode."""
    parity: Literal["error", "warn"] = "error"
    """In invariant mode, what a log-prob difference does: 'error' or 'warn'."""
    parity_sample: int = 1
    """Where a separate pass scores the samples (policy lag, split roles, FSDP2, ...): recompute 1 completion in n,
    a different one of each n rows each step, every one at step 1 (1: all). n > 1 needs invariant mode with
    parity='error': the rows not recomputed take the generator's log-probs, which the check shows are the trainer's
    bits on the others."""
    tensorboard: bool = False
    """Also write every metric to TensorBoard event files in out_dir/tensorboard."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when there is one)."""
    progress: bool = True
    """A progress bar on the terminal (reward, parity) while training."""
    data: DataConfig = field(default_factory=DataConfig)
    """The task and its data: task, task_source, question_field, answer_field, difficulty."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """What the generator samples and how it gets the weights: generator, vllm_model, vllm_memory, keep_graphs,
    sampler_kernels, sampler_precision, sampler_noise, prompts_per_step, group_size, max_new_tokens, temperature,
    sync, policy_lag."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """What the update minimises: loss, clip_low, clip_high, aggregation, old_logprobs, correction, correction_cap,
    kl_coef, kl_to, kl_estimator, kl_in_reward."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """How the update optimises, and which weights: lr, weight_decay, max_grad_norm, master_dtype, mini_batches,
    epochs, max_tokens_per_microbatch, activation_checkpointing, adapter, lora_rank, lora_alpha, lora_targets."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """The ranks' roles under torchrun: rollout_ranks, parallel, trainer_backend, tensor_parallel."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When the run checkpoints and stops: checkpoint_every, resume, time_limit_s."""

    def __post_init__(self):
        check_choices(self)
        check_at_least_one(self, "steps")
        rollout, objective, optim, dist = self.rollout, self.objective, self.optim, self.distributed
        if rollout.sampler_kernels == "engine" and (self.kernel_mode != "standard" or rollout.generator != "embedded"):
            raise ValueError("sampler_kernels='engine' models an inference engine beside a standard trainer: it needs "
                             "kernel_mode='standard' and generator='embedded'")
        if rollout.sampler_precision == "fp8" and (rollout.sampler_kernels != "engine" or optim.adapter != "none"
                                                   or dist.rollout_ranks):
            raise ValueError("sampler_precision='fp8' models an fp8 inference engine beside a bf16 trainer: it needs "
                             "sampler_kernels='engine', adapter='none' and rollout_ranks=0")
        sequences = rollout.prompts_per_step * rollout.group_size
        if optim.mini_batches > sequences:
            raise ValueError(f"mini_batches={optim.mini_batches} exceeds the step's {sequences} sequences")
        if optim.adapter == "lora" and rollout.generator == "vllm":
            raise ValueError("adapter='lora' with generator='vllm' is not supported: vLLM would run the adapters "
                             "through its own LoRA kernels, not the trainer's products, and the weight sync "
                             "moves adapters into the embedded generator only. Use generator='embedded' (exact, "
                             "unmerged), or merge the adapters (python -m workbench lora-merge) and serve the "
                             "merged checkpoint")
        if not isinstance(self.parity_sample, int) or isinstance(self.parity_sample, bool) or self.parity_sample < 1:
            raise ValueError(f"parity_sample must be an integer >= 1 (1: check every completion), got "
                             f"{self.parity_sample!r}")
        if self.parity_sample > 1 and (self.kernel_mode != "invariant" or rollout.sampler_noise
                                       or self.parity != "error"
                                       or (rollout.generator == "vllm" and rollout.vllm_model != "workbench")):
            raise ValueError(f"parity_sample={self.parity_sample} takes the generator's log-probs for the trainer's "
                             "on the rows it does not check, which holds only where they are the same bits: "
                             "kernel_mode='invariant', no sampler_noise, parity='error' (a run that goes on past a "
                             "difference has none of that), the workbench's own generator kernels; set "
                             "parity_sample=1 to recompute every completion")
        if self.parity_sample > sequences:
            raise ValueError(f"parity_sample={self.parity_sample} exceeds the step's {sequences} completions: some "
                             "steps would check none; lower it")
        if dist.rollout_ranks and rollout.generator != "embedded":
            raise ValueError(f"generator={rollout.generator!r} with rollout_ranks > 0 is not supported yet (the "
                             "rollout ranks run the embedded generator): use generator='embedded', or rollout_ranks=0")
        if dist.rollout_ranks and optim.adapter != "none":
            raise ValueError(f"adapter={optim.adapter!r} with rollout_ranks > 0 is not supported yet (the broadcast "
                             "moves whole models, not adapters): use rollout_ranks=0 (colocated) for LoRA")
        if dist.rollout_ranks and rollout.sync != "copy":
            raise ValueError(f"rollout_ranks={dist.rollout_ranks} keeps the generators in processes of their own, "
                             "which get the weights by broadcast: use sync='copy'")
        if dist.parallel == "fsdp2" and (optim.master_dtype != "float32" or optim.adapter != "none"):
            raise ValueError(f"parallel='fsdp2' shards the fp32 masters of full fine-tuning; master_dtype="
                             f"{optim.master_dtype!r} with adapter={optim.adapter!r} has none to shard: set "
                             "master_dtype='float32' and adapter='none', or parallel='replicate'")
        if dist.trainer_backend == "torchtitan" and optim.adapter != "none":
            raise ValueError(f"trainer_backend='torchtitan' trains every weight (torchtitan has no adapters); "
                             f"adapter={optim.adapter!r} needs trainer_backend='workbench', or set adapter='none'")
        if dist.tensor_parallel > 1:
            clashes = {"parallel": ("replicate", dist.parallel), "master_dtype": ("float32", optim.master_dtype),
                       "rollout_ranks": (0, dist.rollout_ranks), "generator": ("embedded", rollout.generator)}
            bad = [f"{k}={now!r}" for k, (ok, now) in clashes.items() if now != ok]
            if bad:
                raise ValueError(f"tensor_parallel={dist.tensor_parallel} is not supported with {', '.join(bad)} "
                                 "(tensor parallelism shards fp32 masters replicated over the data-parallel groups, "
                                 "every rank generating): set parallel='replicate', master_dtype='float32', "
                                 "rollout_ranks=0, generator='embedded', or tensor_parallel=1")

    def loss_config(self) -> LossConfig:
        """The loss's settings: its published ones (`LossSpec.defaults`) with those this config sets."""
        objective = self.objective
        spec = get_loss(objective.loss)
        aggregation = objective.aggregation or spec.defaults.aggregation
        return dataclasses.replace(spec.defaults, eps_low=objective.clip_low or spec.defaults.eps_low,
                                   eps_high=objective.clip_high or spec.defaults.eps_high, aggregation=aggregation,
                                   norm=self.rollout.max_new_tokens if aggregation == "seq-mean-token-sum-norm"
                                   else None)

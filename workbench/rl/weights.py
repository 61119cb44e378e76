"""The weights being trained: the bf16 model the kernels run, the weights AdamW updates, and the update.

master_dtype 'float32': AdamW on fp32 masters whose cast is the bf16 model, dW accumulated in fp32 `main_grad`s
(Megatron-LM's convention); 'bfloat16': AdamW on the bf16 weights themselves (most RL blog posts' setup). With LoRA
the base is frozen and those rules apply to the adapters alone; with FSDP2 the masters are sharded
(`workbench.distributed.fsdp`). The optimizer steps one layer group at a time (AdamW is elementwise, so this is the
same update), so the weight-change metrics never need a clone of the whole model. Each setup and its bytes per
parameter: docs/distributed.md, "`workbench/rl/weights.py`: the trained weights, their dtypes and bytes".
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed import fsdp
from ..models import CausalLM, build, copy_weights, weights_checksum
from ..models.lora import LoraConfig, adapter_state, attach, base_state, copy_adapters, init_adapters
from .metrics import layer_group, weight_delta_metrics

_GRAD_ALIGN = 64
"""Each master's view of the flat gradient buffer starts at a multiple of this many elements (256 bytes): as
aligned as a tensor of its own for the kernels that accumulate into it (a TMA descriptor needs 16 bytes)."""


class TrainWeights:
    def __init__(self, start: CausalLM, master_dtype: str, lr: float, device: str, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, lora: LoraConfig | None = None, seed: int = 0,
                 shard_group: dist.ProcessGroup | None = None):
        """`lora`: freeze `start` as the base and train adapters initialised from `seed`. `shard_group`: shard the
        fp32 masters and AdamW's state over these ranks with FSDP2 (every rank passes the same fp32 `start`)."""
        self.max_grad_norm = max_grad_norm
        self.has_masters = master_dtype == "float32"
        self.lora = lora
        self._bf16: list[torch.Tensor] = []
        self._base_checksum: str | None = None
        self.grad_buffer: torch.Tensor | None = None
        """During an update with masters: every master's fp32 gradient, one flat buffer (None otherwise)."""
        self.sharded = None
        """FSDP2: the sharded fp32 module, its DTensor parameters the masters (None: every tensor whole here)."""
        self.dcp: tuple[torch.nn.Module, dist.ProcessGroup] | None = None
        """The module whose DTensor masters every rank checkpoints its part of (DCP), and those ranks; None: rank 0
        writes the whole tensors."""
        if shard_group is not None:
            if not self.has_masters or lora is not None:
                raise ValueError("FSDP2 shards the fp32 masters of full fine-tuning: master_dtype='float32', no LoRA")
            self.sharded = fsdp.shard(start, shard_group)
            self.dcp = (self.sharded, shard_group)
            self.masters = dict(self.sharded.named_parameters())
            self.model = build(start.config, device=device, dtype=torch.bfloat16, seed=None).requires_grad_(False)
        elif self.has_masters and lora is None:
            # The starting model's own fp32 tensors become the masters: no second copy.
            self.masters = {k: v.detach().float() for k, v in start.state_dict().items()}
            self.model = build(start.config, device=device, dtype=torch.bfloat16, seed=None)
            copy_weights(self.masters, self.model)
        else:
            self.model = start if start.lm_head_weight.dtype == torch.bfloat16 else \
                build(start.config, device=device, dtype=torch.bfloat16, seed=None)
            if self.model is not start:
                copy_weights(dict(start.state_dict()), self.model)
            if lora is None:
                self.masters = dict(self.model.named_parameters())
            else:
                attach(self.model, lora)
                on = self.model.lm_head_weight.device
                init = {k: v.to(on) for k, v in init_adapters(self.model, lora, seed).items()}
                copy_adapters(init, self.model)
                self.masters = init if self.has_masters else adapter_state(self.model)
        if self.has_masters and self.sharded is None:
            self._pair(dict(self.model.named_parameters()))
        self.params = [self.masters[k] for k in sorted(self.masters)]
        # fused: one kernel per step for all tensors (the foreach default takes ~2x the time, several passes).
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, fused=True)
        groups = defaultdict(list)
        for k in sorted(self.masters):
            groups[layer_group(k)].append(self.masters[k])
        self.groups = dict(groups)
        if self.sharded is not None:
            self.sync_model()

    @property
    def module(self):
        """What the update's forward and backward run: the bf16 model, or the FSDP2 module (bf16 compute)."""
        return self.model if self.sharded is None else self.sharded

    @property
    def scorer(self):
        """The trainer's no-grad forward (the parity check's side, the old log-probs): the bf16 model, whole here."""
        return self.model

    def before_backward(self, last: bool) -> None:
        """FSDP2: whether the coming backward is the mini-batch's last, which reduce-scatters the gradients."""
        if self.sharded is not None:
            fsdp.reduce_on_next_backward(self.sharded, last)

    def _pair(self, compute: dict[str, torch.Tensor]) -> None:
        """Each master's bf16 parameter (in `compute`, by the masters' names) adds its gradients into the master's."""
        self._bf16 = [compute[k] for k in self.masters]
        for k, m in self.masters.items():
            m.requires_grad_(True)
            compute[k].register_post_accumulate_grad_hook(self._into_master(m))

    def _into_master(self, master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:   # the gradient went to `main_grad` inside the backward's kernel
                return
            if master.grad is None:
                master.grad = p.grad.float()
            else:
                master.grad.add_(p.grad)   # fp32 += bf16, upcast on the fly
            p.grad = None

        return hook

    def step(self) -> dict[str, float]:
        """AdamW on the accumulated gradients, then the bf16 cast; returns grad_norm and weight-change metrics."""
        grads = {p: p.grad for p in self.params}
        missing = [k for k, p in self.masters.items() if p.grad is None]
        if missing:
            raise RuntimeError(f"no gradient reached {missing[:3]}: the update's backward did not run")
        self._release_main_grads()
        grad_norm = self._clip(list(grads.values())).item()
        # The metrics' sums of squares stay on the device until one transfer at the end: a host sync per
        # tensor (hundreds per step) would stall the GPU between the groups' optimizer steps.
        sq_delta, sq_before = {}, {}
        for p in self.params:
            p.grad = None
        with torch.no_grad():
            for g, params in self.groups.items():
                before = [t.detach().to(torch.float32, copy=True) for t in self._counted(params)]
                for p in params:
                    p.grad = grads[p]
                self.opt.step()
                for p in params:
                    p.grad = None
                sq_before[g] = torch.nn.utils.get_total_norm(before, norm_type=2.0).double().square()
                for b, t in zip(before, self._counted(params)):
                    b.sub_(t)
                sq_delta[g] = torch.nn.utils.get_total_norm(before, norm_type=2.0).double().square()
                del before
        names = list(sq_delta)
        values = self._sum_over_ranks(torch.stack([sq_delta[g] for g in names] + [sq_before[g] for g in names]))
        values = values.tolist()
        sq_delta, sq_before = dict(zip(names, values[: len(names)])), dict(zip(names, values[len(names):]))
        self.sync_model()
        return {"grad_norm": grad_norm, **weight_delta_metrics(sq_delta, sq_before)}

    def _clip(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients' global norm; with max_grad_norm, the gradients scaled down to it where it is larger."""
        if self.sharded is None:
            total = torch.nn.utils.get_total_norm(grads)
        else:   # the shards' sums of squares, summed over the ranks
            total = self._sum_over_ranks(torch.nn.utils.get_total_norm([_local(g) for g in grads]).square()).sqrt()
        if self.max_grad_norm and self.sharded is None:
            # torch's clip_grad_norm_ rule: scale by max_norm / (norm + 1e-6) when that is below 1.
            torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, total)
        elif self.max_grad_norm:   # the same rule on each shard
            scale = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            for g in grads:
                _local(g).mul_(scale)
        return total

    def zero_grad(self) -> None:
        """Before a mini-batch: with masters, their fp32 gradients as zeros, each bf16 parameter's `main_grad`."""
        if self.sharded is not None:
            fsdp.accumulate(self.sharded)
            return
        for p in self.module.parameters():
            p.grad = None
        if not self.has_masters:
            for p in self.params:
                p.grad = None
            return
        sizes = [-(-_local(m).numel() // _GRAD_ALIGN) * _GRAD_ALIGN for m in self.masters.values()]
        device = self.params[0].device
        self.grad_buffer = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        offset = 0
        for m, p, size in zip(self.masters.values(), self._bf16, sizes):
            local = self.grad_buffer[offset: offset + _local(m).numel()].view_as(_local(m))
            # A tensor-parallel master's gradient: this rank's part in the buffer, laid out as the master.
            m.grad = local if not isinstance(m, DTensor) else \
                DTensor.from_local(local, m.device_mesh, m.placements, run_check=False, shape=m.shape,
                                   stride=m.stride())
            p.main_grad = m.grad
            offset += size

    def _release_main_grads(self) -> None:
        # The fp32 gradients are freed after the step (the optimizer holds them until then), so the rollouts
        # between updates have their memory.
        for p in self._bf16:
            p.main_grad = None
        self.grad_buffer = None
        if self.sharded is not None:
            fsdp.release(self.sharded)

    def _counted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors of `params` this rank counts in the weight-change metrics (summed over the ranks by
        `_sum_over_ranks`): FSDP2's local shards, or the tensors themselves."""
        return [_local(p) for p in params]

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """FSDP2: t (sums over this rank's shards) summed over the ranks; else t itself."""
        if self.sharded is not None:
            dist.all_reduce(t, group=fsdp.group(self.sharded))
        return t

    def sync_model(self) -> None:
        """The bf16 model from the masters (after an optimizer step or a resume)."""
        if self.sharded is not None:   # the bf16 cast of the shards, gathered tensor by tensor, checked
            fsdp.gather_bf16(self.sharded, self.model)
            fsdp.check_gathered(self.sharded, self.model)
        elif self.has_masters:
            (copy_weights if self.lora is None else copy_adapters)(
                {k: v.detach() for k, v in self.masters.items()}, self.model)

    def base_checksum(self) -> str:
        """LoRA: the frozen base's checksum (computed once), so a resume can check it restarts on the same base."""
        if self._base_checksum is None:
            self._base_checksum = weights_checksum(base_state(self.model))
        return self._base_checksum


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t

"""The weights being trained: the bf16 model the kernels run, the weights AdamW updates, and the update.

- master_dtype 'float32': AdamW on fp32 masters; the bf16 model is their cast (`copy_weights`, round to
  nearest even), renewed once per optimizer step. Bytes per parameter: bf16 model 2 + masters 4 + their
  gradients 4 + AdamW moments 8 = 18. A parameter's bf16 gradient lives only until the backward has
  accumulated it: a hook adds it into the master's fp32 gradient and frees it, so micro-batches
  accumulate in fp32 and no bf16 gradient stays resident.
- master_dtype 'bfloat16': AdamW on the bf16 weights themselves (bf16 moments, bf16 gradient
  accumulation), the setup of most RL blog posts: 8 bytes per parameter.

The optimizer steps one layer group at a time (AdamW is elementwise and skips parameters without a
gradient, so this is the same update): the group's weights before the step are the only copy the
weight-change metrics need, never a clone of the whole model.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..models import CausalLM, build, copy_weights
from .metrics import layer_group, weight_delta_metrics


class TrainWeights:
    def __init__(self, start: CausalLM, master_dtype: str, lr: float, device: str, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0):
        self.max_grad_norm = max_grad_norm
        self.has_masters = master_dtype == "float32"
        if self.has_masters:
            # The starting model's own fp32 tensors become the masters: no second copy.
            self.masters = {k: v.detach().float() for k, v in start.state_dict().items()}
            self.model = build(start.config, device=device, dtype=torch.bfloat16, seed=None)
            copy_weights(self.masters, self.model)
            named = dict(self.model.named_parameters())
            for k, m in self.masters.items():
                m.requires_grad_(True)
                named[k].register_post_accumulate_grad_hook(self._into_master(m))
        else:
            self.model = start if start.lm_head_weight.dtype == torch.bfloat16 else \
                build(start.config, device=device, dtype=torch.bfloat16, seed=None)
            if self.model is not start:
                copy_weights(dict(start.state_dict()), self.model)
            self.masters = dict(self.model.named_parameters())
        self.params = [self.masters[k] for k in sorted(self.masters)]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        groups = defaultdict(list)
        for k in sorted(self.masters):
            groups[layer_group(k)].append(self.masters[k])
        self.groups = dict(groups)

    @staticmethod
    def _into_master(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
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
        total = torch.nn.utils.get_total_norm(list(grads.values()))
        grad_norm = total.item()
        if self.max_grad_norm:
            # torch's clip_grad_norm_ rule: scale by max_norm / (norm + 1e-6) when that is below 1.
            torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, total)
        sq_delta, sq_before = {}, {}
        for p in self.params:
            p.grad = None
        with torch.no_grad():
            for g, params in self.groups.items():
                before = [p.detach().clone() for p in params]
                for p in params:
                    p.grad = grads[p]
                self.opt.step()
                for p in params:
                    p.grad = None
                sq_before[g] = sum(float(torch.linalg.vector_norm(b.float())) ** 2 for b in before)
                sq_delta[g] = sum(float(torch.linalg.vector_norm(p.float() - b.float())) ** 2
                                  for p, b in zip(params, before))
                del before
        self.sync_model()
        return {"grad_norm": grad_norm, **weight_delta_metrics(sq_delta, sq_before)}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for p in self.model.parameters():
            p.grad = None

    def sync_model(self) -> None:
        """The bf16 model from the masters (after an optimizer step or a resume)."""
        if self.has_masters:
            copy_weights({k: v.detach() for k, v in self.masters.items()}, self.model)

"""torchtitan as the RL update's trainer (`trainer_backend='torchtitan'`): `TitanWeights`, the
`TrainWeights` interface on torchtitan's components. Rollouts, rewards, advantages, losses and the parity check stay
the workbench's; the update runs torchtitan's model (its ops on the workbench's kernels), its optimizer and LR
scheduler builders (constant rate: every factor 1.0), its `clip_grad_norm_`, its FSDP2 recipe and `titan.tp`'s
tensor parallelism. On one process the update is the workbench trainer's bit for bit; where and why the bits
depart under FSDP2 and tensor parallelism, how torchtitan's mixed precision maps onto master_dtype, and why the
checkpoints stay the workbench's: docs/distributed.md, "torchtitan as the trainer".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from ..distributed import fsdp
from ..models import CausalLM, build, copy_weights
from ..titan.model import build_titan_model, titan_args
from ..titan.tp import apply_tp, check_tp
from ..titan.weights import from_titan, titan_to_hf, to_titan
from .config import TrainConfig
from .metrics import layer_group
from .weights import TrainWeights

ADAMW_BETAS = (0.9, 0.999)
"""The workbench's AdamW betas (torch's defaults), set in torchtitan's Optimizer config (its default beta2: 0.95)."""
ADAMW_EPS = 1e-8
"""The workbench's AdamW eps (torch's default and torchtitan's)."""


def _titan():
    """torchtitan's builders, imported here: torchtitan is the `titan` extra."""
    try:
        from torchtitan.components.lr_scheduler import build_lr_schedulers
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config import LRScheduler, Optimizer
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import clip_grad_norm_
        from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division
    except ImportError as e:
        raise ImportError(f"trainer_backend='torchtitan' needs torchtitan ({e}): pip install -e '.[titan]' "
                          "(the version constraints.txt pins), or use trainer_backend='workbench'") from None
    return (build_lr_schedulers, build_optimizers, LRScheduler, Optimizer, ParallelDims, clip_grad_norm_,
            disable_fsdp_gradient_division)


def workbench_order(names) -> list[str]:
    """torchtitan parameter names in the order of their workbench names (the order TrainWeights steps and sums)."""
    renamed = titan_to_hf({k: k for k in names})
    return [renamed[k] for k in sorted(renamed)]


@torch.no_grad()
def share_memory(module: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Every parameter of the titan `module` becomes a parameter over the memory of `tensors`' (torchtitan names)
    same weight, in its dtype; tied parameters stay one. No copy: the module and `tensors` are one set of weights."""
    first = {id(p): k for k, p in module.named_parameters()}
    new: dict[int, nn.Parameter] = {}
    for name, p in list(module.named_parameters(remove_duplicate=False)):
        if id(p) not in new:
            new[id(p)] = nn.Parameter(tensors[first[id(p)]].detach(), requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, new[id(p)])
    return module


def shard(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """torchtitan's FSDP2 recipe on the fp32 titan `model` over `group`: `fully_shard` per TransformerBlock with bf16
    params and fp32 reduce, then the root, gradient division off (`disable_fsdp_gradient_division`: the update's
    losses are normalised by the whole mini-batch). Two departures from torchtitan 0.2.2's `apply_fsdp`:

    - the embeddings, final norm and LM head are the root's one unit, not the units `tok_embeddings` and
      [norm, output]: the exact forward reads their weights into its kernels (the embedding, the fused add and norm,
      the fused log-prob head) without calling those modules' forwards, which is what gathers a unit; and with tied
      embeddings (Qwen3-0.6B/1.7B, SmolLM2) two units would hold one weight, which torch 2.13 refuses at the first
      forward and torch 2.11 silently unties (torchtitan issue #2252);
    - `cast_forward_inputs=False`: floating-point block inputs (the fp32 RoPE cos/sin) stay fp32, as the kernels and
      the generator take them, where torchtitan's policy would round them to bf16.

    Its `ParallelDims.build_mesh` is not used either: it takes the device type torchtitan found at import ('cuda'
    on a machine without one) and the whole job's ranks; the mesh here is the trainer ranks' group on the weights'
    device. The gradient path (fp32 `main_grad` into FSDP2's accumulation buffer) is `workbench.distributed.fsdp`'s.
    """
    *_, disable_division = _titan()
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("FSDP2 shards the fp32 masters: build the titan model in float32 (master_dtype='float32')")
    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "hidden_states")
    disable_division(model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:   # a plain sum on every backend (gloo has no pre-multiplied sum), as workbench.distributed.fsdp
        m.set_force_sum_reduction_for_comms(True)
    # The fp32 gradient path writes into FSDP2's accumulation buffer (internals `fsdp.shard` checks the same way).
    if not all(hasattr(p, "unsharded_accumulated_grad") for p in fsdp._params(model)):
        raise RuntimeError(f"torch {torch.__version__}'s FSDP2 lacks the accumulated-gradient buffer the fp32 gradient "
                           "path writes into; use the torch of constraints.txt, or parallel='replicate'")
    for m in units:   # the unsharded parameter objects, so `fsdp.accumulate` can give them main_grads
        m.unshard()
        m.reshard()
    return model


class TitanWeights(TrainWeights):
    """TrainWeights on torchtitan's model, optimizer, LR scheduler, clipping and FSDP2 recipe (module docstring).
    `masters` are keyed by torchtitan's names and hold its layouts (Llama 3's interleaved q/k rows)."""

    def __init__(self, start: CausalLM, cfg: TrainConfig, device: str, shard_group: dist.ProcessGroup | None = None,
                 tp_mesh: DeviceMesh | None = None):
        """`start`: the starting policy (fp32 with master_dtype='float32'); `shard_group`: the FSDP2 trainer ranks;
        `tp_mesh`: the 1-D mesh of this rank's tensor-parallel group (`tensor_parallel`)."""
        (build_lr_schedulers, build_optimizers, LRScheduler, Optimizer, ParallelDims, self._clip_grad_norm,
         _) = _titan()
        if cfg.optim.adapter != "none":
            raise ValueError("trainer_backend='torchtitan' trains every weight: set adapter='none'")
        if (shard_group is not None or tp_mesh is not None) and cfg.optim.master_dtype != "float32":
            raise ValueError("FSDP2 and tensor parallelism shard the fp32 masters: master_dtype='float32'")
        if shard_group is not None and tp_mesh is not None:
            raise ValueError("tensor_parallel > 1 with parallel='fsdp2' is not supported: use parallel='replicate'")
        self.max_grad_norm = cfg.optim.max_grad_norm
        self.has_masters = cfg.optim.master_dtype == "float32"
        self.lora = None
        self._base_checksum = None
        self.grad_buffer = None
        self.sharded = None
        self.dcp = None
        self._bf16: list[torch.Tensor] = []
        mc = start.config
        titan_args(mc)   # first: a one-line error where torchtitan 0.2.2 has no model for this config
        self.tp = tp_mesh
        if tp_mesh is not None:
            check_tp(mc, tp_mesh.size())
        # The generator's bf16 model, and the same weights under torchtitan's names and layouts on its memory (a
        # weight whose layout differs, Llama 3's q/k, has its own: `_apart`, copied over after each step).
        self.model = start if start.lm_head_weight.dtype == torch.bfloat16 else \
            build(mc, device=device, dtype=torch.bfloat16, seed=None)
        if self.model is not start:
            copy_weights({k: v.detach() for k, v in start.state_dict().items()}, self.model)
        own = {id(p) for p in self.model.parameters()}
        generator = to_titan(dict(self.model.named_parameters()), mc)
        if tp_mesh is None:
            self._view = share_memory(build_titan_model(mc, device, seed=None), generator)
            self._apart = sorted(k for k, _ in self._view.named_parameters() if id(generator[k]) not in own)
        else:   # the bf16 compute model sharded (its own memory: the generator stays whole), every weight apart
            self._view = apply_tp(share_memory(build_titan_model(mc, device, seed=None),
                                               {k: v.detach().clone() for k, v in generator.items()}), tp_mesh)
            self._apart = sorted(k for k, _ in self._view.named_parameters())
        # The parameters the optimizer steps, in a titan model for torchtitan's builders (which take modules): fp32
        # on the start's own tensors (no second copy), sharded by FSDP2, or the bf16 view itself.
        if self.has_masters:
            fp32 = to_titan({k: v.detach().float() for k, v in start.state_dict().items()}, mc)
            master_module = share_memory(build_titan_model(mc, device, torch.float32, seed=None), fp32)
            del fp32
            if tp_mesh is not None:
                master_module = apply_tp(master_module, tp_mesh)
                self.dcp = (master_module, dist.group.WORLD)
        else:
            master_module = self._view
        if shard_group is not None:
            self.sharded = shard(master_module, shard_group)
            self.dcp = (self.sharded, shard_group)
        self.titan = self.sharded if self.sharded is not None else self._view
        named = dict(master_module.named_parameters())
        self.masters = {k: named[k] for k in workbench_order(named)}
        if self.has_masters and self.sharded is None:
            self._pair(dict(self._view.named_parameters()))
        self.params = list(self.masters.values())
        self.groups: dict[str, list] = {}
        for k, hf in zip(self.masters, sorted(titan_to_hf({k: k for k in self.masters}))):
            self.groups.setdefault(layer_group(hf), []).append(self.masters[k])
        world = 1 if shard_group is None else dist.get_world_size(shard_group)
        tp = 1 if tp_mesh is None else tp_mesh.size()
        dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=tp, pp=1, ep=1, etp=1, world_size=world * tp)
        self.optimizers = build_optimizers(
            [master_module], Optimizer(name="AdamW", lr=cfg.optim.lr, beta1=ADAMW_BETAS[0], beta2=ADAMW_BETAS[1],
                                       eps=ADAMW_EPS, weight_decay=cfg.optim.weight_decay, implementation="fused"),
            dims)
        # The torch AdamW torchtitan built (one model part): TrainWeights steps it one layer group at a time, and the
        # workbench's checkpoints save its state as they save their own.
        self.opt = self.optimizers.optimizers[0]
        self.lr_schedulers = build_lr_schedulers(self.optimizers, LRScheduler(warmup_steps=0, decay_ratio=0.0),
                                                 cfg.steps * cfg.optim.epochs * cfg.optim.mini_batches)
        self.sync_model()

    @property
    def module(self):
        """What the update's forward and backward run: the titan model (bf16; tensor parallel: sharded), or the
        FSDP2 titan module."""
        return self.titan

    @property
    def scorer(self):
        """The parity check's trainer forward: the titan model (tensor parallel: the sharded one, a collective of
        the group, whose ranks hold the same rows); with FSDP2 the generator's bf16 model (a sharded forward is a
        collective, and each rank scores its own rows)."""
        return self.titan if self.sharded is None else self.model

    def _counted(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        # Tensor parallel: each rank's shards, and a replicated weight on the group's first rank only (the sums of
        # squares are then the whole weights' once summed over the group).
        if self.tp is None:
            return super()._counted(params)
        first = self.tp.get_local_rank() == 0
        return [p.to_local() if first or p.placements[0].is_shard() else p.to_local()[:0] for p in params]

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:
            dist.all_reduce(t, group=self.tp.get_group())
        return super()._sum_over_ranks(t)

    def _clip(self, grads: list[torch.Tensor]) -> torch.Tensor:
        # torchtitan's clip over the masters in the workbench's order (the norm of the per-tensor norms is a sum
        # whose order sets its last bits); max_norm inf scales by exactly 1.0 where the run does not clip.
        return self._clip_grad_norm(self.params, self.max_grad_norm or math.inf)

    def step(self) -> dict[str, float]:
        """TrainWeights' step on torchtitan's optimizer, then its LR scheduler's step."""
        out = super().step()
        self.lr_schedulers.step()
        return out

    @torch.no_grad()
    def sync_model(self) -> None:
        """The bf16 weights from the masters, into the titan view and so the generator's model: their cast, or with
        FSDP2 each shard's cast, gathered and checked; then the weights laid out apart, back in the workbench's."""
        view = dict(self._view.named_parameters())
        if self.sharded is not None:
            fsdp.gather_bf16(self.sharded, self._view)
            fsdp.check_gathered(self.sharded, self._view)
        elif self.has_masters:
            for k, m in self.masters.items():
                view[k].copy_(m)   # tensor parallel: each rank's part
        # Tensor parallel: the bf16 shards all-gathered over the group (the cast and the gather commute).
        apart = {k: view[k].full_tensor() if self.tp is not None else view[k] for k in self._apart}
        target = dict(self.model.named_parameters())
        for k, t in from_titan(apart, self.model.config).items():
            target[k].copy_(t)

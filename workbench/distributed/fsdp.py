"""FSDP2 trainer ranks: the fp32 masters and AdamW's state sharded over the trainer ranks with torch's own
`fully_shard`, the compute in bf16, the gradients kept in fp32 from the kernels to the masters.

`shard` wraps the fp32 model per decoder layer and at the root (bf16 compute, fp32 reduce). The linear kernels add dW
into each unsharded parameter's fp32 `main_grad` (FSDP2's own accumulation buffer), and the last micro-batch's
backward reduce-scatters the fp32 sums: at world size 2 the replicated trainer's all-reduce to the bit, at any world
size the one-process gradient up to the summation order. `gather_bf16` casts each fp32 shard and all-gathers the bf16
shards (the same bits as a cast after the gather; no rank holds a full fp32 copy). Every rank runs the same forwards
and backwards; the FSDP2 internals used are checked at `shard` time. Imports nothing from `workbench.rl`. In full:
docs/distributed.md, "`workbench/distributed/fsdp.py`: FSDP2 trainer ranks".
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

MIXED_PRECISION = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
"""bf16 compute from fp32 shards, fp32 gradient reduce; float inputs left alone (the kernels want fp32 RoPE tables)."""


def _modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _params(model: nn.Module) -> list:
    """FSDP2's per-parameter objects (`FSDPParam`) of every sharded module, in module order."""
    out = []
    for m in _modules(model):
        group = m._get_fsdp_state()._fsdp_param_group
        if group is not None:
            out.extend(group.fsdp_params)
    return out


def shard(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shards the fp32 `model` (a `CausalLM`) in place over `group` (default: every rank): each decoder layer, then
    the root (embeddings, final norm, LM head). Returns it, its parameters now DTensor shards; call on every rank of
    the group, with the same weights (the caller broadcasts them first)."""
    group = group or dist.group.WORLD
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ValueError("FSDP2 shards the fp32 masters: build the model in float32 (master_dtype='float32')")
    # An explicit mesh from the group and the weights' device: without one, fully_shard takes CUDA wherever torch
    # sees a GPU, even in a gloo group.
    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MIXED_PRECISION)
    fully_shard(model, mesh=mesh, mp_policy=MIXED_PRECISION)
    register_fsdp_forward_method(model, "hidden_states")
    # A sum, not FSDP2's default mean: each rank's loss is already normalised by the whole mini-batch. (Both
    # setters act on one module's groups only.)
    for m in _modules(model):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
    params = _params(model)
    if not params or not all(hasattr(p, "unsharded_accumulated_grad") and hasattr(p, "sharded_param")
                             for p in params):
        raise RuntimeError(f"torch {torch.__version__}'s FSDP2 lacks the accumulated-gradient buffer the fp32 "
                           "gradient path writes into (FSDPParam.unsharded_accumulated_grad); use the torch of "
                           "constraints.txt, or parallel='replicate'")
    # One all-gather creates each unsharded parameter object (kept for the run), so `accumulate` can give it its
    # main_grad before the first forward; then back to shards (the optimizer must see the shards).
    for m in _modules(model):
        m.unshard()
        m.reshard()
    return model


def accumulate(model: nn.Module) -> None:
    """Before a mini-batch's first backward: a zero fp32 `main_grad` on every unsharded parameter, which FSDP2
    accumulates into and reduce-scatters; no reduction until `reduce_on_next_backward(model, True)`."""
    for p in _params(model):
        p.sharded_param.grad = None
        buf = torch.zeros(p._unsharded_param.shape, dtype=torch.float32, device=p.sharded_param.device)
        p.unsharded_accumulated_grad = buf
        p._unsharded_param.main_grad = buf
    model.set_requires_gradient_sync(False)


def reduce_on_next_backward(model: nn.Module, last: bool) -> None:
    """Whether the next backward is the mini-batch's last: then it reduce-scatters the accumulated fp32 sums."""
    model.set_requires_gradient_sync(last)


def release(model: nn.Module) -> None:
    """After the optimizer step: the unsharded fp32 buffers go (the rollouts between updates get their memory)."""
    for p in _params(model):
        p.unsharded_accumulated_grad = None
        if hasattr(p._unsharded_param, "main_grad"):
            del p._unsharded_param.main_grad


def group(model: nn.Module) -> dist.ProcessGroup:
    """The process group the model is sharded over."""
    return next(model.parameters()).device_mesh.get_group()


def named_masters(model: nn.Module) -> Iterator[tuple[str, DTensor]]:
    """The sharded fp32 masters by name, in name order (the order of every gather, on every rank)."""
    for name, p in sorted(model.named_parameters()):
        yield name, p


@torch.no_grad()
def gather_bf16(model: nn.Module, into: nn.Module) -> None:
    """`into` (a plain bf16 model of the same config) gets the bf16 cast of the sharded fp32 masters: per tensor,
    the local shard cast to bf16, all-gathered (`full_tensor`) and copied in. Every rank of the group calls it."""
    target = dict(into.named_parameters())
    for name, p in named_masters(model):
        target[name].copy_(p.detach().to(torch.bfloat16).full_tensor())


@torch.no_grad()
def check_gathered(model: nn.Module, into: nn.Module) -> None:
    """Raises unless this rank's rows of every gathered bf16 tensor are the bits of its own fp32 shard's cast (a
    local check, no collective; the ranks' copies are compared by the replica digest check)."""
    target = dict(into.named_parameters())
    for name, p in named_masters(model):
        local = p.to_local()
        start = _shard_start(p)
        mine = target[name][start: start + local.shape[0]]
        if not torch.equal(mine.view(torch.int16), local.to(torch.bfloat16).view(torch.int16)):
            raise RuntimeError(f"rank {dist.get_rank()}: the gathered bf16 {name} differs from the cast of this "
                               "rank's fp32 shard: the all-gather changed bits; check the ranks' devices and links")


def _shard_start(p: DTensor) -> int:
    """The first row of the full tensor this rank's dim-0 shard holds (FSDP2's chunking: torch.chunk's sizes)."""
    rank, world = p.device_mesh.get_local_rank(), p.device_mesh.size()
    per = -(-p.shape[0] // world)
    return min(rank * per, p.shape[0])


def local_sizes(model: nn.Module) -> dict[str, int]:
    """Elements of each master this rank holds (its shard)."""
    return {name: p.to_local().numel() for name, p in named_masters(model)}

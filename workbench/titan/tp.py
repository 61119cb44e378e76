"""Tensor parallelism for the routed torchtitan model (`model.exact`) whose forward keeps the one-process bits.

`apply_tp(model, mesh)` shards every block's products over a 1-D `DeviceMesh` with torch's `parallelize_module`
(the plan `exact_plan()`); the embedding, the norms, RoPE and the LM head stay replicated. Run it after `exact` and
before FSDP2. The plan is column-parallel everywhere (wo and w2 too, not torchtitan's `RowwiseParallel`): a product
split by its output features gives each element its one-process bits and gathering them back only moves data, where a
row-parallel (split-K) product adds roundings. So the forward's log-probs are the one-process model's, bit for bit;
the backward's summed partial dx differ in their last bits (the parity check compares forward log-probs only).
The numerics, the backward, and the departures from torchtitan's recipe with their communication: docs/distributed.md,
"`workbench/titan/tp.py`: tensor parallelism that keeps the forward's bits".
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel,
                                              parallelize_module)

from ..models import ModelConfig
from .model import _Model


def check_tp(cfg: ModelConfig, degree: int) -> None:
    """A one-line ValueError unless `degree` ranks can split `cfg`'s heads and features evenly (each rank whole
    heads, and the same share of every product's output features)."""
    sizes = {"attention heads": cfg.num_attention_heads, "KV heads": cfg.num_key_value_heads,
             "hidden size": cfg.hidden_size, "MLP width": cfg.intermediate_size}
    if degree < 1:
        raise ValueError(f"the tensor parallel degree must be at least 1, got {degree}")
    bad = [f"{n} {k}" for k, n in sizes.items() if n % degree]
    if bad:
        raise ValueError(f"tensor parallel degree {degree} does not divide the model's {', '.join(bad)}; use a "
                         "degree that divides the attention and KV heads, the hidden size and the MLP width")


class _Sync:
    """torch's Colwise/RowwiseParallel hooks with the redistributions waited for where they run (module docstring)."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, input_layouts, run_check=False)
        return x if x.placements == tuple(desired_input_layouts) else x.redistribute(placements=desired_input_layouts)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != tuple(output_layouts):
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


class Colwise(_Sync, ColwiseParallel):
    """torch's `ColwiseParallel` (weight rows sharded, input replicated), its collectives waited for."""


def exact_plan() -> dict[str, ParallelStyle]:
    """Every block's `parallelize_module` plan, torchtitan's module names: column-parallel everywhere; the heads'
    and the MLP's local outputs are all-gathered at wo's and w2's inputs, wo's and w2's outputs after them. The
    attention's and the MLP's input enters as one replicated DTensor (torchtitan's `PrepareModuleInput`), so the
    partial dx of wq, wk and wv (of w1 and w3) add up on each rank and are all-reduced once."""
    local, gathered = Colwise(), Colwise(input_layouts=Shard(-1), output_layouts=Replicate())
    return {"attention": _replicated_input(4), "feed_forward": _replicated_input(1),
            "attention.wq": local, "attention.wk": local, "attention.wv": local, "attention.wo": gathered,
            "feed_forward.w1": local, "feed_forward.w3": local, "feed_forward.w2": gathered}


def _replicated_input(n_args: int) -> PrepareModuleInput:
    """The first of a module's `n_args` inputs as a replicated DTensor (the rest as they are)."""
    layouts = (Replicate(),) + (None,) * (n_args - 1)
    return PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts, use_local_output=False)


class Rowwise(_Sync, RowwiseParallel):
    """torch's `RowwiseParallel` (weight columns sharded, the partial outputs all-reduced), its collectives waited
    for: torchtitan's style for wo and w2, which does not keep the bits (`rowwise_plan`)."""


def rowwise_plan() -> dict[str, ParallelStyle]:
    """`exact_plan` with torchtitan's choice for wo and w2, `RowwiseParallel` (outputs replicated here, where it
    shards them over the sequence): the split-K products that change the forward's bits. The tests' negative
    control, and the one to measure against where the bits are not needed."""
    return {**exact_plan(), "attention.wo": Rowwise(output_layouts=Replicate()),
            "feed_forward.w2": Rowwise(output_layouts=Replicate())}


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: dict | None = None) -> nn.Module:
    """Shard the routed `model`'s blocks over the 1-D `mesh` by `plan` (default `exact_plan()`; `rowwise_plan()` is
    torchtitan's wo/w2), in place; returns the model. Every rank must hold the same weights (the shards are cut from
    rank 0's)."""
    if not isinstance(model, _Model):
        raise TypeError("apply_tp shards the routed model: call titan.model.exact(model, cfg) first")
    if mesh.ndim != 1:
        raise ValueError(f"apply_tp takes a 1-D mesh of the tensor-parallel ranks, got {mesh.ndim} dimensions")
    check_tp(model.config, mesh.size())
    for block in model.layers.values():
        parallelize_module(block, mesh, exact_plan() if plan is None else plan)
    # The rest replicated as DTensors, as torchtitan's plan leaves none plain: torch's fused and foreach optimizers
    # and its gradient norm refuse a mix of DTensors and plain tensors. A tied head stays one parameter.
    replicated: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if not isinstance(p, DTensor):
            if id(p) not in replicated:
                replicated[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]), p.requires_grad)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, replicated[id(p)])
    return model

"""Tensor parallelism for the routed torchtitan model (`model.exact`) whose forward keeps the one-process bits.

`apply_tp(model, mesh)` shards every block's products over the ranks of a 1-D `DeviceMesh` with torch's
`parallelize_module`, the plan `exact_plan()`; the embedding, the norms (q/k norm included), RoPE and the LM head stay
replicated, their parameters Replicate DTensors (every parameter is a DTensor, as torchtitan's TP leaves them: torch's
fused AdamW, its gradient norm and DCP take them). An fp32 `main_grad` on a parameter (a DTensor laid out as it) takes
the kernels' dW on each rank's shard as on one process. Run it after `exact` and before FSDP2 (as torchtitan's
`parallelize` orders TP first); on a meta-device model too, then `to_empty` and load (torchtitan's trainer's order).

Numerics. An invariant product's output element depends only on its row of x, its row of W and the K loop, so a
product sharded by its OUTPUT features (column-parallel: each rank the rows of W for its features, x whole) gives
each of its elements' one-process bits, and gathering the features back is a move of data. A product sharded by its
input features (row-parallel: K split, the partial sums all-reduced) adds two roundings and another order; it cannot
give the bits. So the exact plan is column-parallel everywhere:
- wq, wk, wv by heads (their outputs stay local: attention runs on this rank's heads, q/k norm and RoPE per head);
- wo by output features, its input (the heads' outputs) all-gathered first, its output all-gathered after;
- w1, w3 by hidden features (silu_mul runs on the local features), w2 by output features, its input all-gathered.
The forward's log-probs are then the one-process model's, bit for bit (tests/test_titan_tp.py).
The backward is not: a column-parallel product's dx is this rank's partial sum over its output features (rounded to
the activation dtype), and the ranks' partials are summed by the all-reduce (and by the reduce-scatter that is the
all-gather's backward), where one process sums all features in one fp32 loop. Every dW is a product over the tokens
of its own rows, exact given its dy, so the gradients that no partial dx reaches (the head, the final norm, the
last block's w2) keep their bits and the others differ in their last bits (measured in tests/test_titan_tp.py). The
parity check compares forward log-probs only, so it still passes every step.

Departures from torchtitan 0.2.2's recipe (`models/qwen3/infra/parallelize.py`, `apply_non_moe_tp`):
- wo and w2 are column-parallel, not `RowwiseParallel`: row-parallel is the split-K product above (the negative
  control in the tests). The price, per block: the forward's two all-reduces of [B, T, H] (one without sequence
  parallelism) become four all-gathers, of wo's input [B, T, heads * D], its output, w2's input [B, T, MLP width]
  (the largest) and its output; the backward adds two reduce-scatters (those inputs' gradients) to the two
  all-reduces both plans have (the attention's and the MLP's input gradients), and both sum the q/k norm weights'
  gradients (torch's CommDebugMode on the tiny model);
- no sequence parallelism (`SequenceParallel` norms, `Shard(1)` block outputs) and no vocabulary-parallel head
  (`loss_parallel`): the fused add-and-norm and the fused log-prob head run on whole rows as the generator's do; a
  vocabulary-sharded log-softmax would combine the ranks' maxima and sums in another order;
- the styles redistribute synchronously (`_Sync`): torch's wait for the collective only at the next torch op on the
  tensor, and the Triton kernels read the memory by pointer.
torchtitan's attention leaves `n_heads` at the model's count and infers the local heads from the shapes (`view(...,
-1, head_dim)`); the routed attention does the same.
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

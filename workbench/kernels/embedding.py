"""`embedding(ids, weight)` = weight[ids], the token embedding, forward and backward.

One path, in every mode (not an op of the mode switch): the forward is a gather, and the backward's kernel
below is deterministic and row-wise already.

Numerics contract:
- Forward: F.embedding, a gather: each output row is a copy of a weight row, exact, the same bits on every
  device, for every batch.
- Backward (the weight's gradient; ids have none): dW[v] = the sum of dy's rows whose id is v. The ids are
  flattened and sorted by a stable sort, so equal ids form runs that keep their token order. The program holding a
  run's first sorted position sums the run's rows in that order, one fp32 chain per column (-0.0 + dy[t0] +
  dy[t1] + ..., each row upcast exactly; -0.0 is the identity of the fp32 add, so the chain is the rows' own
  sum), then adds the sum into row v of the target with one fp32 add. No atomics, no split of a run, no host
  sync: deterministic run to run, and a row of dW depends on its own tokens' gradients and their order alone,
  not on the other ids or the batch's size. Only fp32 adds of exactly upcast values (no multiply, so no FMA
  contraction can form): the interpreter computes the GPU's sums (reasoned, not compared across devices).
- Target: the weight parameter's fp32 `main_grad` when it carries one (Megatron-LM's convention, as `linear`
  and `linear_logprobs`: the micro-batch's sums land in the master gradient, never rounded to bf16, with no
  [V, H] pass; no gradient is returned), else fp32 zeros [V, H], cast once to the weight's dtype (torch's
  cast, round to nearest even) and returned. torch's own dense embedding backward (a zero-filled [V, H]
  gradient in the weight's dtype and a scatter) sums in an order and a precision of its backend's choosing.

Cost: the sort, then one pass over dy. A program takes a block of sorted positions; each that starts a run walks
it in order, one row a step, the block's runs side by side: a long run (a padding id repeated thousands of
times) takes time in proportion to its length, not its bytes (BENCHMARKS.md, "Numbers behind the code").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .runtime import check_float, check_same, interpreting, next_power_of_2, pdl_enter, pdl_flags


@triton.jit
def _embedding_bwd_kernel(ids_ptr, order_ptr, dy_ptr, out_ptr, n, H, stride_dy, stride_out,
                          POSITIONS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # Program (b, c): sorted positions [b * POSITIONS, (b + 1) * POSITIONS), columns [c * BLOCK_H, (c + 1) *
    # BLOCK_H). ids_ptr: the sorted ids (all >= 0, so -1 marks "no position"); order_ptr: each sorted position's
    # row of dy. Each position that starts a run walks it, one row a step; the block's runs go side by side.
    pdl_enter(PDL)
    p = tl.program_id(0).to(tl.int64) * POSITIONS + tl.arange(0, POSITIONS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    v = tl.load(ids_ptr + p, mask=p < n, other=-1)
    starts = (v >= 0) & (tl.load(ids_ptr + p - 1, mask=(p > 0) & (p < n), other=-1) != v)
    acc = tl.full((POSITIONS, BLOCK_H), -0.0, tl.float32)
    live = starts
    q = p
    while tl.max(live.to(tl.int32), axis=0) > 0:
        # A finished run's row is masked and adds -0.0: its sum is unchanged.
        row = tl.load(order_ptr + q, mask=live, other=0).to(tl.int64)
        acc += tl.load(dy_ptr + row[:, None] * stride_dy + cols[None, :], mask=live[:, None] & cmask[None, :],
                       other=-0.0).to(tl.float32)
        q += 1
        live = live & (tl.load(ids_ptr + q, mask=live & (q < n), other=-1) == v)
    ptrs = out_ptr + v.to(tl.int64)[:, None] * stride_out + cols[None, :]
    first = starts[:, None] & cmask[None, :]
    tl.store(ptrs, tl.load(ptrs, mask=first, other=0.0) + acc, mask=first)


# Sorted positions per program: on a GPU one (the form timed below). The interpreter's cost is mostly per
# statement: 256 positions and up to 256 columns a program (one position and 64 columns a program took 3 s for
# 640 tokens of width 64 there, this 0.3 s). A run's chain of adds is the same whichever program walks it.
_GPU_POSITIONS, _INTERPRETER_POSITIONS = 1, 256


def _launch_backward(ids: torch.Tensor, dy: torch.Tensor, out: torch.Tensor) -> None:
    """out[ids[i]] += dy[i] for every i (out fp32 [V, H], rows contiguous), each id's rows summed in token order
    in fp32 first."""
    flat = ids.reshape(-1)
    n, h = flat.numel(), out.shape[1]
    if n == 0 or h == 0:
        return
    dy2 = dy.reshape(n, h).contiguous()
    sorted_ids, order = torch.sort(flat, stable=True)
    block = min(next_power_of_2(h), 256) if interpreting() else 256
    positions = _INTERPRETER_POSITIONS if interpreting() else _GPU_POSITIONS
    _embedding_bwd_kernel[(triton.cdiv(n, positions), triton.cdiv(h, block))](
        sorted_ids, order, dy2, out, n, h, dy2.stride(0), out.stride(0),
        POSITIONS=positions, BLOCK_H=block, num_warps=2, **pdl_flags(dy2),
    )


class EmbeddingFn(torch.autograd.Function):
    """(ids, weight) -> weight[ids]."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        # The parameter object itself, for its `main_grad` (as LinearFn: a tensor saved for the backward may come
        # back as another object, without the attribute).
        ctx.param = weight
        ctx.weight_meta = (weight.shape, weight.dtype, weight.device)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None
        (ids,) = ctx.saved_tensors
        shape, dtype, device = ctx.weight_meta
        main_grad = getattr(ctx.param, "main_grad", None)
        if main_grad is not None:
            if main_grad.dtype != torch.float32 or main_grad.shape != shape or main_grad.stride(1) != 1:
                raise ValueError(f"embedding: the weight's `main_grad` must be an fp32 {tuple(shape)} tensor with "
                                 f"contiguous rows, got {main_grad.dtype} {tuple(main_grad.shape)} strides "
                                 f"{tuple(main_grad.stride())}")
            _launch_backward(ids, dy, main_grad)
            return None, None
        dw32 = torch.zeros(shape, device=device, dtype=torch.float32)
        _launch_backward(ids, dy, dw32)
        return None, dw32.to(dtype)


def _check(ids: torch.Tensor, weight: torch.Tensor) -> None:
    op = "embedding"
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"{op}: `ids` must be an int64 or int32 tensor, got {got}")
    check_float(op, "weight", weight)
    if weight.dim() != 2:
        raise ValueError(f"{op}: `weight` must be 2-D [V, H], got shape {tuple(weight.shape)}")
    check_same(op, {"weight": weight, "ids": ids}, dtype=False)
    if weight.requires_grad and torch.is_grad_enabled() and weight.device.type != "cuda" and not interpreting():
        raise RuntimeError(f"{op}: the gradient's Triton kernel needs a CUDA tensor (got one on {weight.device}); "
                           "on a CPU-only machine set TRITON_INTERPRET=1 before importing workbench")


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [...] int64/int32, weight [V, H] (bf16 or fp32) -> weight[ids] [..., H]. Differentiable in weight: the
    gradient goes into `weight.main_grad` (fp32) when the parameter carries one, else it is returned in the
    weight's dtype."""
    _check(ids, weight)
    return EmbeddingFn.apply(ids, weight)


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp64 reference of the forward."""
    return weight.double()[ids]


def embedding_grad_reference(ids: torch.Tensor, dy: torch.Tensor, num_embeddings: int) -> torch.Tensor:
    """fp64 reference of the backward: d(weight) [V, H] of sum(embedding(ids, weight) * dy), dy's rows summed per id."""
    h = dy.shape[-1]
    return torch.zeros((num_embeddings, h), device=dy.device, dtype=torch.float64).index_add_(
        0, ids.reshape(-1), dy.reshape(-1, h).double())

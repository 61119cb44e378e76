"""Projections that read the same input (q/k/v; gate/up) laid out in one buffer, so the generator's forward
(`decoding.DecodingModel`) runs them as one product: each parameter stays its own `nn.Parameter`, a view of the
buffer, so training, checkpoints and adapters see the usual names and shapes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def pack_projections(projs: Sequence[nn.Module]) -> None:
    """Lay the projections' weights (and biases) out one after another in one buffer, each parameter a view of
    it, so the generator's forward can run them as one product (`packed_projections`). Copies; call after
    loading."""
    for kind in ("weight", "bias"):
        old = [getattr(p, kind) for p in projs]
        if old[0] is None:
            continue
        buf = torch.cat([t.detach() for t in old])
        for p, t, view in zip(projs, old, buf.split([t.shape[0] for t in old])):
            setattr(p, kind, nn.Parameter(view, requires_grad=t.requires_grad))


def packed_projections(projs: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [sum of N, H], bias) over the projections' parameters where `pack_projections` laid them out and
    they still are (a `.to()` moves each parameter alone), without adapters or hooks on the projections (`audit`
    watches each one run); else None. Each output column is the same chain of k-steps as in its own projection
    (invariant mode), so the same bits, in one launch instead of several. Views of the parameters' storage,
    outside autograd: they read every later update made in place."""
    if any(p.lora_A is not None or p._forward_hooks or p._forward_pre_hooks for p in projs):
        return None
    out = []
    for kind in ("weight", "bias"):
        ts = [getattr(p, kind) for p in projs]
        if ts[0] is None:
            out.append(None)
            continue
        offset, ptr = ts[0].storage_offset(), ts[0].untyped_storage().data_ptr()
        for t in ts:
            if t.untyped_storage().data_ptr() != ptr or t.storage_offset() != offset or not t.is_contiguous():
                return None
            offset += t.numel()
        rows = sum(t.shape[0] for t in ts)
        out.append(ts[0].detach().as_strided((rows, *ts[0].shape[1:]), ts[0].stride()))
    return out[0], out[1]

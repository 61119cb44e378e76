"""The one switch between the `invariant` kernels and the `standard` path.

- `invariant`: this package's Triton kernels. Every output element is reduced
  in one fixed order, whatever the batch size, the row's position, the other
  rows or padding.
- `standard`: the usual fast path (cuBLAS through `F.linear`, PyTorch ops):
  the mismatched control.

A mode is a default plus per-op overrides, so an experiment can make one op
mismatched and keep the rest exact:

    with mode("invariant", linear="standard"):
        ...

The state lives in a `ContextVar`, so threads and async tasks each see their
own mode. The default, before any call, is `invariant`.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .registry import REGISTRY

MODES = ("invariant", "standard")
OPS = tuple(name for name, op in REGISTRY.items() if op.mode_switch)
"""The op names a mode override can name: the registry's ops marked `mode_switch` (the others follow these)."""

FUSED_ROWWISE: Mapping[str, str] = MappingProxyType({"rms_norm": "invariant", "silu_mul": "invariant",
                                                     "apply_rope": "invariant"})
"""The overrides that make `standard` the fast standard baseline, `mode("standard", **FUSED_ROWWISE)`: cuBLAS and
FlashAttention stay; the row-wise ops (one row in, one row out, nothing reduced across rows, so nothing that could
follow the batch) take this package's fused kernels instead of Hugging Face's eager formulas with their fp32 round
trips, as vLLM's fused norm, RoPE and SiLU kernels and Liger's replace them in the systems people run. Generation
then also writes the KV cache in the fused RoPE kernel. The mismatch between generator and trainer stays, from the
matmuls and attention."""


@dataclass(frozen=True)
class ModeState:
    default: str = "invariant"
    overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, op: str) -> str:
        return self.overrides.get(op, self.default)


_STATE: contextvars.ContextVar[ModeState] = contextvars.ContextVar(
    "workbench_kernel_mode", default=ModeState()
)


def _check_mode(name: str, where: str) -> str:
    if name not in MODES:
        raise ValueError(f"unknown kernel mode {name!r} for {where}; choose one of {MODES}")
    return name


def _check_whole_gpu() -> None:
    """Invariant bits are a function of the shapes on a whole GPU. Under a capped CUDA MPS share the process sees
    fewer SMs, and on an H200 a 25% share changed an invariant generation's bits even with every tile choice pinned
    to `matmul_tiles.PINNED_SMS` (tests/test_gpu_mps.py): something outside the tile rules follows the SMs. So
    an invariant mode refuses a capped share rather than give bits that depend on what else shares the GPU."""
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    try:
        capped = float(share) < 100
    except ValueError:
        return   # unset (or not a number, which CUDA itself refuses)
    if capped:
        raise RuntimeError(f"invariant kernels need the whole GPU, but CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share} "
                           "caps this process's share of its SMs: unset it (MPS itself is fine), or run standard")


def _make_state(name: str | None, overrides: Mapping[str, str]) -> ModeState:
    current = _STATE.get()
    if name == "invariant":
        _check_whole_gpu()
    if name is None:  # keep the current default and overrides, add these
        overrides = {**current.overrides, **overrides}
    default = _check_mode(name, "the default") if name is not None else current.default
    for op, op_mode in overrides.items():
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in a mode override; known ops: {sorted(OPS)}")
        _check_mode(op_mode, f"op {op!r}")
    return ModeState(default, MappingProxyType(dict(overrides)))


@contextlib.contextmanager
def mode(name: str | None = None, **overrides: str) -> Iterator[ModeState]:
    """Run a block in mode `name` with these per-op overrides; with no name, keep the current
    default and overrides and add these."""
    token = _STATE.set(_make_state(name, overrides))
    try:
        yield _STATE.get()
    finally:
        _STATE.reset(token)


def set_mode(name: str, **overrides: str) -> ModeState:
    """Set the mode for the rest of this context (a notebook, a script)."""
    state = _make_state(name, overrides)
    _STATE.set(state)
    return state


def get_mode(op: str | None = None) -> str:
    """The mode in force for `op`, or the default when `op` is None."""
    state = _STATE.get()
    return state.default if op is None else state.of(op)


def current_state() -> ModeState:
    return _STATE.get()

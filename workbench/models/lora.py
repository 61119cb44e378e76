"""LoRA adapters on the model's projections: the config, attaching and detaching them, their names, merging.

An adapted projection holds a frozen W [out, in] and trained A [r, in], B [out, r] and computes, unmerged in the
trainer and the generator alike (so the two run the same products on the same weights):

    y = linear(x, W) + scale * linear(linear(x, A), B),   scale = alpha / r

The products go through `kernels.linear` and the sum through `kernels.lora_add`, so in `invariant` mode a row's
output has its own bits whatever else is in the batch. A merged model (`merge`: fp32, cast once) is the same function,
not the same bits: it is for serving. Initialisation is PEFT's (B zeros: the adapted model starts as the base), drawn
on the CPU in fp32 so that every device and dtype gets the same numbers. The numerics contract per output element:
docs/lora.md, "`workbench/models/lora.py`: the adapter's numerics contract".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA can adapt (PEFT's `target_modules` names); the default targets all seven."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    """r: the adapters' inner width."""
    alpha: float = 32.0
    """The adapters' output is scaled by alpha / r."""
    targets: tuple[str, ...] = PROJECTIONS
    """Projections that get an adapter."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora_rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora_alpha must be a finite number > 0, got {self.alpha!r}")
        targets = tuple(self.targets)
        unknown = [t for t in targets if t not in PROJECTIONS]
        if not targets or unknown or len(set(targets)) != len(targets):
            raise ValueError(f"lora_targets must be distinct names among {', '.join(PROJECTIONS)}, got "
                             f"{list(targets)}")
        object.__setattr__(self, "targets", tuple(t for t in PROJECTIONS if t in targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (`...q_proj.lora_A` / `.lora_B`)."""
    return name.endswith((".lora_A", ".lora_B"))


def targets_of(model: torch.nn.Module, cfg: LoraConfig) -> dict[str, torch.nn.Module]:
    """{module name: projection} of the model's projections that `cfg` adapts, in model order."""
    return {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in cfg.targets}


def attach(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """Add adapters (A and B zeroed, in the model's dtype and device) to the targeted projections and freeze
    every other parameter. Fill them with `copy_adapters` (e.g. from `init_adapters`).

    The adapters are views of one flat buffer (`adapter_flat`), laid out in module order, so a sync between two
    models with the same adapters is one copy and one comparison, not a few hundred of each."""
    if getattr(model, "lora", None) is not None:
        raise ValueError("the model already has LoRA adapters attached; detach them first")
    for p in model.parameters():
        p.requires_grad_(False)
    mods = list(targets_of(model, cfg).values())
    shapes = [((cfg.rank, m.weight.shape[1]), (m.weight.shape[0], cfg.rank)) for m in mods]
    w = mods[0].weight
    flat = torch.zeros(sum(_padded(math.prod(s)) for pair in shapes for s in pair), device=w.device, dtype=w.dtype)
    offset = 0
    for m, pair in zip(mods, shapes):
        for name, shape in zip(("lora_A", "lora_B"), pair):
            n = math.prod(shape)
            setattr(m, name, torch.nn.Parameter(flat[offset: offset + n].view(shape)))
            offset += _padded(n)
        m.lora_scale = cfg.scale
    model.lora = cfg
    model.lora_flat = flat
    model.lora_modules = mods


def _padded(n: int) -> int:
    # Each view starts 128-byte aligned (bf16): the matmul's TMA descriptors need 16-byte aligned operands.
    return -(-n // 64) * 64


def adapter_flat(model: torch.nn.Module) -> torch.Tensor | None:
    """The flat buffer every adapter of `model` is a view of (`attach`), or None where one no longer is (the
    model was moved by `.to()`, or an adapter replaced)."""
    flat = getattr(model, "lora_flat", None)
    if flat is None:
        return None
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    for m in model.lora_modules:   # attach's list: a walk over every module would cost host time every sync
        if not (m.lora_A is not None and lo <= m.lora_A.data_ptr() < hi and lo <= m.lora_B.data_ptr() < hi):
            return None
    return flat


def detach(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Remove the adapters (returns them, by name); the base's parameters stay frozen."""
    adapters = adapter_state(model)
    for m in model.modules():
        if getattr(m, "lora_A", None) is not None:
            m.lora_A = m.lora_B = None
            m.lora_scale = 0.0
    model.lora = None
    model.lora_flat = model.lora_modules = None
    return adapters


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: parameter} of the adapters, in name order."""
    return dict(sorted((k, p) for k, p in model.named_parameters() if is_adapter(k)))


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of everything but the adapters (the frozen base)."""
    return {k: v for k, v in model.state_dict().items() if not is_adapter(k)}


def init_adapters(model: torch.nn.Module, cfg: LoraConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's initialisation of every adapter of `cfg` on `model`: {name: fp32 CPU tensor}, A Kaiming-uniform
    (a = sqrt(5)) drawn in module order from one seeded generator, B zeros."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, m in targets_of(model, cfg).items():
        n_out, n_in = m.weight.shape
        a = torch.empty(cfg.rank, n_in)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        out[f"{name}.lora_A"], out[f"{name}.lora_B"] = a, torch.zeros(n_out, cfg.rank)
    return out


def copy_adapters(src: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Copy adapter weights into the model's adapters in place (`copy_`, round to nearest even: the one cast
    path, and CUDA graphs holding the parameters' addresses stay valid). The names must match exactly."""
    params = adapter_state(model)
    if set(src) != set(params):
        missing, unexpected = sorted(set(params) - set(src)), sorted(set(src) - set(params))
        raise KeyError(f"adapters do not match the model's: missing {missing[:3]}, unexpected {unexpected[:3]}; "
                       "attach the same LoRA config (rank, targets) on both sides")
    for k, p in params.items():
        if src[k].shape != p.shape:
            raise ValueError(f"{k}: the model's adapter has shape {tuple(p.shape)}, the source "
                             f"{tuple(src[k].shape)}; use the same lora_rank")
    with torch.no_grad():  # one multi-tensor launch for the few hundred adapters, not one copy each
        torch._foreach_copy_(list(params.values()), [src[k].to(p.device) for k, p in params.items()])


def merge(model: torch.nn.Module) -> None:
    """Fold the adapters into the base weights in place, W + scale * B @ A (computed in fp32, cast once to W's
    dtype), and detach them."""
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "lora_A", None) is not None:
                w = torch.addmm(m.weight.float(), m.lora_B.float(), m.lora_A.float(), alpha=m.lora_scale)
                m.weight.copy_(w)
    detach(model)

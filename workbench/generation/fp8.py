"""The fp8 sampler (`sampler_precision='fp8'`, the `off-fp8` arm): the generator runs its decoder's products W8A8 in
float8_e4m3fn as vLLM's default fp8 (`quantization="fp8"` on a bf16 checkpoint) runs them, beside a bf16 trainer,
from its own fp8 copy of the weights refreshed at every sync.

Numerics contract: the decoder layers' projections only (the embedding, norms, RoPE, attention, LM head and KV cache
stay bf16). Weights: one scale per tensor vLLM holds (q/k/v share one, gate/up another), s_w = amax|W| / 448 in
fp32, codes e4m3(W / s_w). Activations: per token, s_a = max(amax|x_row| / 448, 1 / (448 * 512)), codes
e4m3(clamp(x / s_a, -448, 448)) (on a GPU by one Triton kernel, kernels/quantize_fp8.py, the same bits). Product:
y = bf16((q_a @ q_w.T) * s_a * s_w (+ b)), the codes' products exact and summed in fp32 (on fp8 tensor cores by
`torch._scaled_mm` at compute capability 9.0 or newer, in fp32 elsewhere; q/k/v and gate/up each one product over
one quantized input: only the sums' order differs). Why each choice, the bias and the sources: docs/generation.md,
"`workbench/generation/fp8.py`: the fp8 sampler's numerics contract".
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.quantize_fp8 import FP8_MAX, quantize_fp8
from ..kernels.quantize_fp8 import quantize_fp8_reference as quantize_rows
from ..models import build
from ..models.transformer import CausalLM

FP8 = torch.float8_e4m3fn
_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
           ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
"""Per layer, the projections quantized with one scale (vLLM's fused parameters), by their module."""


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes e4m3 [N, K], scale fp32 []) of one tensor, dynamic per tensor."""
    w32 = w.detach().float()
    scale = w32.abs().amax() / w32.new_tensor(FP8_MAX)      # IEEE on a GPU too (`quantize_fp8_reference`)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))   # an all-zero weight: codes 0 at any scale
    return (w32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes e4m3 [M, K], scales fp32 [M, 1]) of the rows of x [..., K], dynamic per token: on a GPU one Triton
    launch (the ATen form is eight per input, most of a graph-captured decode step's launches); elsewhere the ATen
    form, whose bits the kernel's are (tests/test_quantize_fp8.py), as the interpreter would run a Python program
    per row."""
    return (quantize_fp8 if x.is_cuda else quantize_rows)(x.reshape(-1, x.shape[-1]))


def _tensor_cores(x: torch.Tensor, n: int) -> bool:
    """Whether `torch._scaled_mm` runs this product: a GPU of sm90 or newer (row-wise scales), K and N multiples
    of 16 (its layout rule)."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 and x.shape[-1] % 16 == 0
            and n % 16 == 0)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x[..., K] (bf16) @ (codes[N, K] x scale).T, W8A8 as the module docstring states; bf16 [..., N].
    scale: fp32 [1, N], the weight's one scale in every column (the row-wise layout `_scaled_mm` reads)."""
    return _product(x, quantize_activations(x), codes, scale, bias)


def _product(x, quantized, codes, scale, bias):
    qa, sa = quantized
    n = codes.shape[0]
    if _tensor_cores(x, n):
        y = torch._scaled_mm(qa, codes.t(), scale_a=sa, scale_b=scale, out_dtype=torch.bfloat16,
                             use_fast_accum=False)
    else:
        y = ((qa.float() @ codes.float().t()) * (sa * scale)).to(torch.bfloat16)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], n)


class _Group:
    """The projections of one fused vLLM parameter (q/k/v; gate/up; o; down alone): their codes, scale and bias
    each in one buffer, refilled in place by `Fp8Sampler.load` (a captured decode graph reads the new ones), the
    projections' buffers views of them. So `packing.packed_projections` finds q/k/v and gate/up laid out as one
    weight and the decoding view runs each group as one product over one quantized input (`packed_product`).
    The model's own forward runs each projection alone: the group's input is then quantized once, by the first of
    them, and reused by the others (the same values). Held by identity: the held input cannot be freed and another
    tensor take its place."""

    def __init__(self, widths: list[int], n_in: int, bias: bool, device):
        n = sum(widths)
        self.codes = torch.zeros((n, n_in), dtype=FP8, device=device)
        self.scale = torch.ones((1, n), dtype=torch.float32, device=device)
        self.bias = torch.zeros(n, dtype=torch.bfloat16, device=device) if bias else None
        self.widths = widths
        self.x, self.quantized = None, None

    def quantize(self, x: torch.Tensor):
        if self.x is not x:
            self.x, self.quantized = x, quantize_activations(x)
        return self.quantized


class Fp8Linear(nn.Module):
    """A projection of the fp8 sampler: views of its group's codes, scale and bias as buffers, no parameters.
    Named `weight` and `lora_A` as `Linear`'s, so the decoding view finds a group's projections packed as the bf16
    model's and takes the same paths (the fused rope and cache write too), their product this module's."""

    def __init__(self, group: _Group, index: int):
        super().__init__()
        start = sum(group.widths[:index])
        rows = slice(start, start + group.widths[index])
        self.register_buffer("weight", group.codes[rows])
        self.register_buffer("weight_scale", group.scale[:, rows])
        self.register_buffer("bias", None if group.bias is None else group.bias[rows])
        self.lora_A = None
        self.group = group

    def forward(self, x):
        return _product(x, self.group.quantize(x), self.weight, self.weight_scale, self.bias)

    def packed_product(self, codes: torch.Tensor, bias: torch.Tensor | None):
        """x -> the group's outputs side by side, for `packing.packed_projections`' (codes, bias) of the group:
        one quantization of x and one product (only the fp32 sums' order may differ from each projection's own)."""
        scale = self.group.scale
        return lambda x: fp8_linear(x, codes, scale, bias)


class Fp8Sampler:
    """The generator's fp8 copy of a bf16 `CausalLM`: `model` is what `generate` samples with; `load(source)`
    refreshes it from the bf16 generator weights (every sync), never writing to them."""

    def __init__(self, source: CausalLM):
        cfg, dev = source.config, source.lm_head_weight.device
        if getattr(source, "lora", None) is not None:
            raise ValueError("sampler_precision='fp8' quantizes whole weights: it does not run LoRA adapters")
        self.model = build(cfg, device=dev, dtype=torch.bfloat16, seed=None)
        for layer in self.model.model.layers:
            for part, names in _GROUPS:
                parent = getattr(layer, part)
                old = [getattr(parent, name) for name in names]
                group = _Group([p.weight.shape[0] for p in old], old[0].weight.shape[1], old[0].bias is not None, dev)
                for i, name in enumerate(names):
                    setattr(parent, name, Fp8Linear(group, i))
        self.load(source)

    @torch.no_grad()
    def load(self, source: CausalLM) -> None:
        """The fp8 codes and scales of `source`'s projections, and a copy of its other weights, in place."""
        for mine, theirs in zip(self.model.model.layers, source.model.layers):
            for part, names in _GROUPS:
                src = [getattr(getattr(theirs, part), n) for n in names]
                group = getattr(getattr(mine, part), names[0]).group
                codes, scale = quantize_weight(torch.cat([p.weight for p in src]))
                group.codes.copy_(codes)
                group.scale.fill_(scale)
                if group.bias is not None:
                    group.bias.copy_(torch.cat([p.bias for p in src]))
        # The rest (embedding, norms, an untied LM head): the projections hold buffers, not parameters.
        theirs = dict(source.named_parameters())
        for name, p in self.model.named_parameters():
            p.copy_(theirs[name])

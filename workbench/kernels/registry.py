"""Every op of the kernel library, by name: its invariant and standard paths,
its fp64 reference and a maker of random inputs. The parity audit and the
generic tests loop over `REGISTRY`.

Each op is row-wise: the first dimension of every tensor argument listed in
`row_args`, and of the output, is the batch of rows whose results must not
depend on each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention, logprobs, lora_add, matmul, matmul_tiles, rmsnorm, rope, silu_mul

# (small: interpreter-friendly, real: Qwen3-1.7B widths)
_SIZES = {
    "small": dict(k=96, n=80, hidden=72, inter=200, heads=3, head_dim=16, vocab=600,
                  seq=19, q_heads=4, kv_heads=2),
    "real": dict(k=2048, n=4096, hidden=2048, inter=6144, heads=16, head_dim=128, vocab=151936,
                 seq=64, q_heads=16, kv_heads=8),
}


@dataclass(frozen=True)
class Op:
    name: str
    invariant: Callable
    standard: Callable
    reference: Callable
    make_inputs: Callable[..., tuple]
    """make_inputs(rows, size, generator, device, dtype) -> positional args."""
    row_args: tuple[int, ...]
    """Indices of the arguments whose first dimension is the row batch."""
    grad_args: tuple[int, ...]
    """Indices of the arguments that get gradients."""
    tile_config: Callable[[], dict]
    """The launch config of the invariant kernels here, for the environment record."""
    max_rows: int = 64
    """The largest batch the generic tests draw (an attention row is a whole sequence)."""


def _randn(shape, g, device, dtype, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _linear_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    return (_randn((rows, s["k"]), g, device, dtype), _randn((s["n"], s["k"]), g, device, dtype, s["k"] ** -0.5))


def _rms_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    return (_randn((rows, s["hidden"]), g, device, dtype, 3.0), _randn((s["hidden"],), g, device, dtype, 0.2) + 1, 1e-6)


def _silu_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    return (_randn((rows, s["inter"]), g, device, dtype, 2.0), _randn((rows, s["inter"]), g, device, dtype))


def _rope_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    pos = torch.randint(0, 40960, (rows,), generator=g).to(device)
    cos, sin = rope.rope_cos_sin(pos, rope.rope_inv_freq(s["head_dim"], 1_000_000.0, device=device))
    return (_randn((rows, s["heads"], s["head_dim"]), g, device, dtype), cos, sin)


def _logit_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    logits = _randn((rows, s["vocab"]), g, device, dtype, 4.0)
    tokens = torch.randint(0, s["vocab"], (rows,), generator=g).to(device)
    return logits, tokens


def _attention_inputs(rows, size, g, device, dtype):
    s = _SIZES[size]
    t, d = s["seq"], s["head_dim"]
    q = _randn((rows, t, s["q_heads"], d), g, device, dtype)
    k = _randn((rows, t, s["kv_heads"], d), g, device, dtype)
    v = _randn((rows, t, s["kv_heads"], d), g, device, dtype)
    lens = torch.randint(1, t + 1, (rows,), generator=g).to(device)
    return q, k, v, lens


def _entropy_inputs(rows, size, g, device, dtype):
    return _logit_inputs(rows, size, g, device, dtype)[:1]


def _lora_add_inputs(rows, size, g, device, dtype):
    n = _SIZES[size]["inter"]  # a projection's output; scale = alpha / r with PEFT's common alpha = 2r
    return _randn((rows, n), g, device, dtype), _randn((rows, n), g, device, dtype, 0.1), 2.0


REGISTRY: dict[str, Op] = {
    op.name: op
    for op in (
        Op("linear", matmul.linear_invariant, matmul.linear_standard, matmul.linear_reference,
           _linear_inputs, row_args=(0,), grad_args=(0, 1), tile_config=matmul_tiles.tile_config),
        Op("rms_norm", rmsnorm.rms_norm_invariant, rmsnorm.rms_norm_standard, rmsnorm.rms_norm_reference,
           _rms_inputs, row_args=(0,), grad_args=(0, 1), tile_config=rmsnorm.tile_config),
        Op("silu_mul", silu_mul.silu_mul_invariant, silu_mul.silu_mul_standard, silu_mul.silu_mul_reference,
           _silu_inputs, row_args=(0, 1), grad_args=(0, 1), tile_config=silu_mul.tile_config),
        Op("apply_rope", rope.apply_rope_invariant, rope.apply_rope_standard, rope.apply_rope_reference,
           _rope_inputs, row_args=(0, 1, 2), grad_args=(0,), tile_config=rope.tile_config),
        Op("token_logprobs", logprobs.token_logprobs_invariant, logprobs.token_logprobs_standard,
           logprobs.token_logprobs_reference, _logit_inputs, row_args=(0, 1), grad_args=(0,),
           tile_config=logprobs.tile_config),
        Op("attention", attention.attention_invariant, attention.attention_standard,
           attention.attention_reference, _attention_inputs, row_args=(0, 1, 2, 3), grad_args=(0, 1, 2),
           tile_config=attention.tile_config, max_rows=16),
        Op("entropy", logprobs.entropy_invariant, logprobs.entropy_standard, logprobs.entropy_reference,
           _entropy_inputs, row_args=(0,), grad_args=(0,), tile_config=logprobs.tile_config),
        Op("lora_add", lora_add.lora_add_invariant, lora_add.lora_add_standard, lora_add.lora_add_reference,
           _lora_add_inputs, row_args=(0, 1), grad_args=(0, 1), tile_config=lora_add.tile_config),
    )
}

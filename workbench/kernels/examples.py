"""Example inputs for every op of the registry, and the row-major form of the ops whose signature is not one.

The generic checks (tests, the parity audit) call an op as `fn(*args) -> one tensor [rows, ...]`, and slice, pad
or swap the rows of the arguments `Op.row_args` names. Ops that write in place (the KV cache, the record), return
tuples, or take a flattened batch get a `<op>_rows` form here that builds what they need per call and returns
one tensor, row r holding what row r produced; `<op>_rows_reference` is the same around the op's reference.
"""

from __future__ import annotations

import torch

from . import gumbel, logprobs, record, rmsnorm, rope, rope_cache
from .attention_paged import attention_paged, attention_paged_reference, paged_kv_write, paged_kv_write_reference
from .attention_varlen import attention_varlen, attention_varlen_reference
from .linear_logprobs import linear_logprobs, linear_logprobs_reference
from .matmul import linear_invariant
from .quantize_fp8 import quantize_fp8, quantize_fp8_reference
from .silu_mul import silu_mul_invariant

# (small: interpreter-friendly, real: Qwen3-1.7B widths)
SIZES = {
    "small": dict(k=96, n=80, hidden=72, inter=200, heads=3, head_dim=16, vocab=600,
                  seq=19, q_heads=4, kv_heads=2, page=8, record=9),
    "real": dict(k=2048, n=4096, hidden=2048, inter=6144, heads=16, head_dim=128, vocab=151936,
                 seq=64, q_heads=16, kv_heads=8, page=64, record=256),
}
_EPS = 1e-6
_SEED = 1234          # gumbel_argmax's sampling seed
_TEMPERATURE = 0.7
_STOP = (3, 7, 11)    # the record's stop tokens
_SLOT_STRIDE = 5      # paged_kv_write: token t's slot lies in [t * stride, (t + 1) * stride)


def _randn(shape, g, device, dtype, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _randint(high, shape, g, device, low=0):
    return torch.randint(low, high, shape, generator=g).to(device)


def _cos_sin(positions, head_dim, device):
    return rope.rope_cos_sin(positions, rope.rope_inv_freq(head_dim, 1_000_000.0, device=device))


# The ops of the mode switch.

def linear_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return (_randn((rows, s["k"]), g, device, dtype), _randn((s["n"], s["k"]), g, device, dtype, s["k"] ** -0.5))


def rms_norm_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return (_randn((rows, s["hidden"]), g, device, dtype, 3.0), _randn((s["hidden"],), g, device, dtype, 0.2) + 1,
            _EPS)


def silu_mul_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return (_randn((rows, s["inter"]), g, device, dtype, 2.0), _randn((rows, s["inter"]), g, device, dtype))


def apply_rope_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    cos, sin = _cos_sin(_randint(40960, (rows,), g, device), s["head_dim"], device)
    return (_randn((rows, s["heads"], s["head_dim"]), g, device, dtype), cos, sin)


def token_logprobs_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return _randn((rows, s["vocab"]), g, device, dtype, 4.0), _randint(s["vocab"], (rows,), g, device)


def attention_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    t, d = s["seq"], s["head_dim"]
    q = _randn((rows, t, s["q_heads"], d), g, device, dtype)
    k = _randn((rows, t, s["kv_heads"], d), g, device, dtype)
    v = _randn((rows, t, s["kv_heads"], d), g, device, dtype)
    return q, k, v, _randint(t + 1, (rows,), g, device, low=1)


def logits_inputs(rows, size, g, device, dtype):
    return token_logprobs_inputs(rows, size, g, device, dtype)[:1]


def lora_add_inputs(rows, size, g, device, dtype):
    n = SIZES[size]["inter"]  # a projection's output; scale = alpha / r with PEFT's common alpha = 2r
    return _randn((rows, n), g, device, dtype), _randn((rows, n), g, device, dtype, 0.1), 2.0


# Ops that follow the switch of others, or have one path.

def embedding_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return _randint(s["vocab"], (rows,), g, device), _randn((s["vocab"], s["hidden"]), g, device, dtype)


def norm_rope_inputs(rows, size, g, device, dtype):
    x, cos, sin = apply_rope_inputs(rows, size, g, device, dtype)
    return x, _randn((x.shape[-1],), g, device, dtype, 0.2) + 1, cos, sin, _EPS


def norm_rope_unfused(x, weight, cos, sin, eps):
    return rope.apply_rope_invariant(rmsnorm.rms_norm_invariant(x, weight, eps), cos, sin)


def swiglu_product_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return (_randn((rows, s["k"]), g, device, dtype),
            _randn((2 * s["inter"], s["k"]), g, device, dtype, s["k"] ** -0.5))


def swiglu_product_rows(x, gate_up):
    from .swiglu_product import swiglu_product

    out = swiglu_product(x, gate_up)
    if out is None:
        raise RuntimeError("swiglu_product does not apply here (bf16 operands, a Hopper GPU or the interpreter)")
    return out


def swiglu_product_unfused(x, gate_up):
    gate, up = gate_up.chunk(2)
    return silu_mul_invariant(linear_invariant(x, gate), linear_invariant(x, up))


def linear_logprobs_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    return (_randn((rows, s["k"]), g, device, dtype), _randn((s["vocab"], s["k"]), g, device, dtype, s["k"] ** -0.5),
            _randint(s["vocab"], (rows,), g, device))


def linear_logprobs_rows(hidden, weight, tokens):
    """[N, 2]: log-prob and entropy."""
    return torch.stack(linear_logprobs(hidden, weight, tokens, _TEMPERATURE, with_entropy=True), 1)


def linear_logprobs_rows_reference(hidden, weight, tokens):
    return torch.stack(linear_logprobs_reference(hidden, weight, tokens, _TEMPERATURE), 1)


def linear_logprobs_unfused(hidden, weight, tokens):
    logits = linear_invariant(hidden, weight)
    return torch.stack(logprobs.logprobs_and_entropy_invariant(logits, tokens, _TEMPERATURE), 1)


def rope_cache_write_inputs(rows, size, g, device, dtype):
    """q, k, v [B, T, H, D] of a prefill chunk at start[b] (up to 7), the fp32 tables, Qwen3's norm weights."""
    s = SIZES[size]
    t, d = 3, s["head_dim"]
    start = _randint(8, (rows,), g, device)
    cos, sin = _cos_sin(start[:, None] + torch.arange(t, device=device), d, device)
    q, k, v = (_randn((rows, t, s[h], d), g, device, dtype) for h in ("q_heads", "kv_heads", "kv_heads"))
    qn, kn = (_randn((d,), g, device, dtype, 0.2) + 1 for _ in range(2))
    return q, k, v, cos, sin, start, qn, kn


def _cache_rows(fn, q, k, v, cos, sin, start, qn, kn, dtype):
    cache_k, cache_v = (torch.zeros((q.shape[0], q.shape[1] + 8, *k.shape[2:]), device=q.device, dtype=dtype)
                        for _ in range(2))
    out = fn(q, k, v, cos, sin, cache_k, cache_v, start, qn, kn, _EPS)
    return torch.cat([out.flatten(1).to(dtype), cache_k.flatten(1), cache_v.flatten(1)], 1)


def rope_cache_write_rows(q, k, v, cos, sin, start, qn, kn):
    """[B, ...]: the rotated q, then the row's K and V cache (zeros where not written)."""
    return _cache_rows(rope_cache.rope_cache_write, q, k, v, cos, sin, start, qn, kn, q.dtype)


def rope_cache_write_rows_reference(q, k, v, cos, sin, start, qn, kn):
    return _cache_rows(rope_cache.rope_cache_write_reference, q, k, v, cos, sin, start, qn, kn, torch.float64)


def rope_cache_write_unfused(q, k, v, cos, sin, start, qn, kn):
    def fn(q, k, v, cos, sin, cache_k, cache_v, start, qn, kn, eps):
        rk = rope.apply_rope_invariant(rmsnorm.rms_norm_invariant(k, kn, eps), cos, sin)
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        pos = start.long()[:, None] + torch.arange(q.shape[1], device=q.device)
        cache_k[rows, pos], cache_v[rows, pos] = rk, v
        return rope.apply_rope_invariant(rmsnorm.rms_norm_invariant(q, qn, eps), cos, sin)
    return _cache_rows(fn, q, k, v, cos, sin, start, qn, kn, q.dtype)


def gumbel_argmax_inputs(rows, size, g, device, dtype):
    logits, _ = token_logprobs_inputs(rows, size, g, device, dtype)
    return logits, _randint(2**31, (rows,), g, device), _randint(40960, (rows,), g, device)


def gumbel_argmax_rows(logits, request_ids, positions):
    return gumbel.gumbel_argmax(logits, _TEMPERATURE, _SEED, request_ids, positions)


def gumbel_argmax_rows_reference(logits, request_ids, positions):
    u = gumbel.uniforms(_SEED, request_ids, positions, logits.shape[-1])
    return gumbel.gumbel_argmax_reference(logits, _TEMPERATURE, u)


def attention_paged_inputs(rows, size, g, device, dtype):
    """A decode step: one query a sequence against its kv_len keys (up to `seq`), in pages of a shared pool that
    the block tables name in random order (pages may be shared: only reads)."""
    s = SIZES[size]
    page, d = s["page"], s["head_dim"]
    width = -(-s["seq"] // page)
    n_pages = 4 * width
    q = _randn((rows, s["q_heads"], d), g, device, dtype)
    table = torch.stack([torch.randperm(n_pages, generator=g)[:width] for _ in range(rows)]).to(device, torch.int32)
    kv_len = _randint(s["seq"] + 1, (rows,), g, device, low=1).to(torch.int32)
    k_pages, v_pages = (_randn((n_pages, page, s["kv_heads"], d), g, device, dtype) for _ in range(2))
    return q, table, kv_len, k_pages, v_pages


def _one_query_each(fn, q, table, kv_len, k_pages, v_pages):
    # A sequence without keys (padding) has no query row: its row of the output stays zeros.
    real = kv_len > 0
    cu_q = torch.cat([real.new_zeros(1, dtype=torch.int32), real.cumsum(0, dtype=torch.int32)])
    out = torch.zeros(q.shape, device=q.device, dtype=torch.float64 if fn is attention_paged_reference else q.dtype)
    out[real] = fn(q[real], k_pages, v_pages, table, cu_q, kv_len, 1)[: int(real.sum())].to(out.dtype)
    return out


def attention_paged_rows(q, table, kv_len, k_pages, v_pages):
    return _one_query_each(attention_paged, q, table, kv_len, k_pages, v_pages)


def attention_paged_rows_reference(q, table, kv_len, k_pages, v_pages):
    return _one_query_each(attention_paged_reference, q, table, kv_len, k_pages, v_pages)


def _packed(fn, q, k, v, lens):
    # The padded batch [B, T, H, D] packed end to end (each sequence's lens[b] real rows), through `fn`, and
    # unpacked: row b holds sequence b's output, zeros on its padding. Differentiable in q, k, v.
    real = torch.arange(q.shape[1], device=q.device)[None, :] < lens.to(q.device)[:, None]      # [B, T]
    cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device=q.device, dtype=torch.int32)
    o = fn(q[real], k[real], v[real], cu, int(lens.max()) if lens.numel() else 0)
    return torch.zeros(q.shape, device=q.device, dtype=o.dtype).index_put((real,), o)


def attention_varlen_rows(q, k, v, lens):
    """`attention_varlen` on `attention_inputs`' padded batch packed without its padding ([B, T, Hq, D])."""
    return _packed(attention_varlen, q, k, v, lens)


def attention_varlen_rows_reference(q, k, v, lens):
    return _packed(attention_varlen_reference, q, k, v, lens)


def paged_kv_write_inputs(rows, size, g, device, dtype):
    s = SIZES[size]
    k, v = (_randn((rows, s["kv_heads"], s["head_dim"]), g, device, dtype) for _ in range(2))
    return k, v, _randint(_SLOT_STRIDE, (rows,), g, device)


def _written(fn, k, v, offsets):
    # Token t's slot is t * stride + offset[t] (distinct by construction), in NaN pages sized for the batch.
    page = 4
    n_pages = -(-max(k.shape[0], 1) * _SLOT_STRIDE // page)
    k_pages, v_pages = (torch.full((n_pages, page, *k.shape[1:]), float("nan"), device=k.device, dtype=k.dtype)
                        for _ in range(2))
    slots = torch.arange(k.shape[0], device=k.device) * _SLOT_STRIDE + offsets
    fn(k, v, k_pages, v_pages, slots)
    return torch.stack([k_pages.flatten(0, 1)[slots], v_pages.flatten(0, 1)[slots]], 1)


def paged_kv_write_rows(k, v, offsets):
    """[N, 2, Hkv, D]: what token t's slot holds after the write."""
    return _written(paged_kv_write, k, v, offsets)


def paged_kv_write_rows_reference(k, v, offsets):
    return _written(paged_kv_write_reference, k, v, offsets)


def row_cumsum_inputs(rows, size, g, device, dtype):
    """Probabilities, as top-p sorts and sums them."""
    logits, _ = token_logprobs_inputs(rows, size, g, device, torch.float32)
    return (torch.softmax(logits, -1).sort(-1, descending=True).values.to(dtype),)


def rms_norm_add_inputs(rows, size, g, device, dtype):
    x, w, eps = rms_norm_inputs(rows, size, g, device, dtype)
    return x, _randn(x.shape, g, device, dtype, 3.0), w, eps


def rms_norm_add_rows(x, residual, weight, eps):
    """[N, 2, H]: the normalised row, then the sum."""
    return torch.stack(rmsnorm.rms_norm_add(x, residual, weight, eps), 1)


def rms_norm_add_rows_reference(x, residual, weight, eps):
    return torch.stack(rmsnorm.rms_norm_add_reference(x, residual, weight, eps), 1)


def record_add_inputs(rows, size, g, device, dtype):
    """A record of `rows` requests (some done), the step's token, log-probs and column; every row steps."""
    n = SIZES[size]["record"]
    tokens = _randint(50, (rows, n), g, device)
    raw, sampled = (_randn((rows, n), g, device, torch.float32) for _ in range(2))
    n_out = _randint(n, (rows,), g, device)
    done = (torch.rand(rows, generator=g) < 0.3).to(device)
    tok = _randint(16, (rows,), g, device)
    lp, slp = (_randn((rows,), g, device, torch.float32) for _ in range(2))
    return tokens, raw, sampled, n_out, done, tok, lp, slp, torch.tensor(int(torch.randint(0, n, (), generator=g)))


def _recorded(fn, tokens, raw, sampled, n_out, done, tok, lp, slp, column):
    state = [t.clone() for t in (tokens, raw, sampled, n_out, done)]
    stop = torch.tensor(_STOP, device=tokens.device)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    fn(*state, rows, column.to(tokens.device), tok, lp, slp, stop)
    t, r, s, n, d = state
    return torch.cat([t, r.view(torch.int32).long(), s.view(torch.int32).long(), n[:, None], d.long()[:, None]], 1)


def record_add_rows(*args):
    """int64 [B, 3N + 2]: the record's tokens, log-probs' and sampled log-probs' bits, count and done flag."""
    return _recorded(record.record_add, *args)


def record_add_rows_reference(*args):
    return _recorded(record.record_add_reference, *args)


def quantize_fp8_inputs(rows, size, g, device, dtype):
    """Activations of a decoder's width, each row at its own magnitude (10^-7 to 10^2: the scale floor's rows
    too)."""
    magnitude = 10.0 ** (torch.rand((rows, 1), generator=g) * 9 - 7)
    return ((torch.randn((rows, SIZES[size]["hidden"]), generator=g) * magnitude).to(device=device, dtype=dtype),)


def _code_bits(codes, scale):
    return torch.cat([codes.view(torch.uint8).long(), scale.view(torch.int32).long()], dim=1)


def quantize_fp8_rows(x):
    """int64 [M, K + 1]: a row's e4m3 codes' bits, then its scale's."""
    return _code_bits(*quantize_fp8(x))


def quantize_fp8_rows_reference(x):
    return _code_bits(*quantize_fp8_reference(x))

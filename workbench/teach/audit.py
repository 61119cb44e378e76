"""The parity audit: every op of the kernel registry, then the whole model op by op.

`kernel_audit`: for each op and mode, a row computed inside batches of M rows (at the first,
middle and last position) against the same row computed alone: bitwise equal or not, the largest
distance in ulps, and the batch's error against the fp64 reference. In `invariant` mode every
entry must be bitwise equal; `standard` mode shows where the usual kernels are batch variant.

`first_divergence`: the trainer's forward (the sequence as row 0 of a batch of others) against
the generator's decode step (batch 1, the KV cache filled by a prefill), op output by op output
in execution order, under whatever mode and per-op overrides are in force. The first op whose
output differs is where generator and trainer part ways.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import bf16
from ..kernels import REGISTRY, mode
from ..models import KVCache, CausalLM
from ..models.transformer import Linear, RMSNorm


def _rows(args: tuple, row_args: tuple[int, ...], index) -> tuple:
    return tuple(a[index] if i in row_args else a for i, a in enumerate(args))


def _max_ulp(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance in ulps of a's dtype (for integer outputs, token ids or copies: the largest difference)."""
    if not a.is_floating_point():
        return int((a - b).abs().max()) if a.numel() else 0
    if a.dtype == torch.float64:
        return 0
    return int(torch.as_tensor(bf16.ulp_distance(a.float(), b.float())).max())


def kernel_audit(batch_sizes=(1, 5, 37), size: str = "small", device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0, ops=None,
                 modes=("invariant", "standard")) -> pd.DataFrame:
    """One row per (op, mode, batch size, position): bitwise_equal, max_ulp (in ulps of `dtype`), err_vs_fp64.
    Ops with one path (or a fused kernel of invariant mode alone) appear in `invariant` mode only."""
    out = []
    for name in ops or sorted(REGISTRY):
        op = REGISTRY[name]
        limit = op.max_rows if device == "cpu" else op.max_rows_gpu
        sizes = [m for m in batch_sizes if m <= limit] or [1]
        dt = dtype if dtype in op.dtypes else op.dtypes[-1]
        args = op.make_inputs(max(sizes), size, torch.Generator().manual_seed(seed), device, dt)
        for mode_name in modes:
            fn = getattr(op, mode_name)
            if fn is None:  # one path in every mode, or a fused kernel of invariant mode alone
                continue
            for m in sizes:
                batch = _rows(args, op.row_args, slice(0, m))
                y = fn(*batch)
                ref = op.reference(*batch).double()
                err = float((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                for position, r in (("first", 0), ("middle", m // 2), ("last", m - 1)):
                    alone = fn(*_rows(batch, op.row_args, slice(r, r + 1)))
                    out.append({"op": name, "mode": mode_name, "rows": m, "position": position,
                                "bitwise_equal": bool(torch.equal(y[r : r + 1], alone)),
                                "max_ulp": _max_ulp(y[r : r + 1], alone), "err_vs_fp64": err})
    return pd.DataFrame(out).drop_duplicates(["op", "mode", "rows", "position"])


def audit_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per op and mode: bitwise everywhere?, the worst ulp distance, the worst error vs fp64."""
    return (table.groupby(["op", "mode"], sort=True)
            .agg(bitwise_everywhere=("bitwise_equal", "all"), max_ulp=("max_ulp", "max"),
                 err_vs_fp64=("err_vs_fp64", "max"))
            .reset_index())


def _capture(model: CausalLM, records: list):
    """Hooks that append (name, output) for every kernel-backed op of the model, in execution order."""
    hooks = []
    for name, mod in model.named_modules():
        if name.endswith("o_proj"):      # its input is the attention kernel's output
            hooks.append(mod.register_forward_pre_hook(
                lambda m, inp, n=name[: -len("o_proj")] + "attention": records.append((n, inp[0]))))
        if name.endswith("down_proj"):   # its input is silu_mul's output
            hooks.append(mod.register_forward_pre_hook(
                lambda m, inp, n=name[: -len("down_proj")] + "silu_mul": records.append((n, inp[0]))))
        if isinstance(mod, (Linear, RMSNorm)):
            hooks.append(mod.register_forward_hook(lambda m, inp, o, n=name: records.append((n, o))))
    return hooks


@torch.no_grad()
def first_divergence(model: CausalLM, seq_len: int = 12, batch: int = 8, seed: int = 0) -> pd.DataFrame:
    """Trainer (row 0 of a batch, last position) vs generator (decode step of that position), per op.

    Returns one row per op output in execution order: name, layer, op, equal, max_abs_diff, max_ulp.
    `table.attrs["first"]` names the first differing op (None when every output is bitwise equal).
    """
    cfg = model.config
    dev = model.lm_head_weight.device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g).to(dev)
    seq = ids[:1]
    trainer_records: list = []
    hooks = _capture(model, trainer_records)
    try:
        trainer_logits = model(ids)                                               # [B, T, V]
    finally:
        for h in hooks:
            h.remove()
    cache = KVCache.allocate(cfg, 1, seq_len, dev, model.lm_head_weight.dtype)
    zero = torch.zeros(1, device=dev, dtype=torch.int32)
    model(seq[:, :-1], cache=cache, start=zero)                                   # prefill T-1 tokens
    gen_records: list = []
    hooks = _capture(model, gen_records)
    try:
        gen_logits = model(seq[:, -1:], cache=cache, start=zero + seq_len - 1)    # decode the last one
    finally:
        for h in hooks:
            h.remove()
    trainer_records.append(("logits", trainer_logits))
    gen_records.append(("logits", gen_logits))
    if len(trainer_records) != len(gen_records):
        raise RuntimeError(f"the trainer ran {len(trainer_records)} ops but the decode step {len(gen_records)}")
    rows = []
    for (name, t_out), (g_name, g_out) in zip(trainer_records, gen_records):
        if name != g_name:
            raise RuntimeError(f"the trainer and generator ran different ops ({name} vs {g_name})")
        a, b = t_out[0, seq_len - 1].float(), g_out[0, 0].float()
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        rows.append({"name": name, "layer": layer, "op": parts[-1], "equal": bool(torch.equal(a, b)),
                     "max_abs_diff": float((a - b).abs().max()), "max_ulp": int(bf16.ulp_distance(a, b).max())})
    table = pd.DataFrame(rows)
    differing = table[~table.equal]
    table.attrs["first"] = None if differing.empty else differing.iloc[0]["name"]
    return table


def divergence_sweep(model: CausalLM, settings: dict[str, dict], **kw) -> pd.DataFrame:
    """first_divergence under several mode settings, e.g. {"all invariant": {"default": "invariant"},
    "attention standard": {"default": "invariant", "attention": "standard"}}; one row per setting."""
    rows = []
    for label, setting in settings.items():
        setting = dict(setting)
        with mode(setting.pop("default", "invariant"), **setting):
            table = first_divergence(model, **kw)
        first = table.attrs["first"]
        hit = table[table.name == first].iloc[0] if first else None
        rows.append({"setting": label, "ops_compared": len(table), "ops_differing": int((~table.equal).sum()),
                     "first_divergence": first or "none (bitwise identical)",
                     "first_layer": None if hit is None else hit["layer"],
                     "first_max_abs_diff": 0.0 if hit is None else hit["max_abs_diff"],
                     "logits_equal": bool(table.iloc[-1]["equal"])})
    return pd.DataFrame(rows)


# kernel_audit shapes: interpreter-sized widths on a CPU; Qwen3-1.7B widths and batches that cross
# every matmul bucket on a GPU.
AUDIT_SMOKE = {"batch_sizes": (1, 5, 37), "size": "small"}
AUDIT_FULL = {"batch_sizes": (1, 7, 33, 64, 300, 1024), "size": "real"}

# Which kernels run in standard mode while the rest stay invariant (default: the whole model).
DIVERGENCE_SETTINGS = {
    "all invariant": {"default": "invariant"},
    "all standard": {"default": "standard"},
    "invariant, attention standard": {"default": "invariant", "attention": "standard"},
    "invariant, linear standard": {"default": "invariant", "linear": "standard"},
    "invariant, rms_norm standard": {"default": "invariant", "rms_norm": "standard"},
}

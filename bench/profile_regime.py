"""The regime step taken apart phase by phase, each phase beside its physical floor (issue 59, item 1).

The `regime` preset's step (SmolLM2-135M-Instruct or --policy, the counting task, 64 sequences = 8 prompts x 8,
its own lr: the timings are of real updates) runs a few steps at each max_new_tokens (default 512, 1024, 2048), for
the `on` arm and for the engine `off` arm, the same-run baseline; the first --warmup steps (compiles, graph
captures) are left out of the medians (bench/step_breakdown.py's phases: generate, score, update, sync, other).

The floors, on the measured mean completion length L of the step's B sequences (N parameters; a lower bound
each: every term left out would only add):
- generate (memory): each of L decode steps reads the weights once (2N bytes, bf16) and every row's keys and values
  so far (2 x layers x kv heads x head dim x 2 bytes a token), so 2N L + B (L^2 / 2) kv bytes over the HBM
  bandwidth. Left out: the prompts' keys, the prefill, a longest sequence longer than the mean, the logits.
- score (compute): a forward, 2 N FLOPs a completion token, B L tokens, at the dense bf16 peak; left out:
  attention's own FLOPs and the prompts' tokens. 0 where the update's forward scored the step (its time is
  then the update's).
- update (compute): forward and backward, 6 N FLOPs a token, B L tokens a pass over the step (x epochs); the same
  left out.
- sync: the bytes the sync moved (0 for shared weights) over the HBM bandwidth. other: no floor.
Defaults: an H200's 4.8 TB/s and 990e12 bf16 FLOP/s (dense).

    python bench/profile_regime.py [--policy DIR] [--lengths 512 1024 2048] [--steps 3] [--out FILE.md]
                                   [--set max_tokens_per_microbatch=32768 ...]
    python bench/profile_regime.py --smoke --out FILE.md     # CPU: the tiny self-trained policy, 4 tokens
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pandas as pd

from workbench.models import build
from workbench.models.checkpoint import read_config
from workbench.models.config import ModelConfig
from workbench.models.hub import resolve_model
from workbench.config import parse_overrides
from workbench.onoff.config import OnOffConfig, preset
from workbench.onoff.runner import execute, run_status, starting_policy

from step_breakdown import PARTS, breakdown
from timing import emit

HBM_BYTES_S = 4.8e12
"""An H200's HBM3e bandwidth."""
BF16_FLOPS = 990e12
"""An H200's (H100 SXM's) dense bf16 tensor-core peak."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the floors need of the policy."""

    params: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, cfg: ModelConfig | str) -> Shape:
        """Of a model config, or of the policy (registry name, folder) that `cfg` names."""
        cfg = read_config(resolve_model(cfg)) if isinstance(cfg, str) else cfg
        params = sum(p.numel() for p in build(cfg, device="meta", seed=None).parameters())
        return cls(params, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2)


def floors(shape: Shape, sequences: int, length: float, epochs: int, scored: bool, sync_bytes: float,
           hbm: float, flops: float) -> dict[str, float]:
    """Each phase's floor in seconds (the module docstring's model) at mean completion length `length`."""
    tokens = sequences * length
    decode_bytes = 2 * shape.params * length + sequences * length ** 2 / 2 * shape.kv_bytes_per_token
    return {"generate": decode_bytes / hbm, "score": 2 * shape.params * tokens / flops if scored else 0.0,
            "update": 6 * shape.params * tokens * epochs / flops, "sync": sync_bytes / hbm}


def profile(preset_name: str, smoke: bool, policy: str, arms: tuple[str, ...], lengths: tuple[int, ...], steps: int,
            warmup: int, out_dir: Path, hbm: float, flops: float, overrides: dict | None = None) -> pd.DataFrame:
    """One row per arm x length x phase (and the whole step): measured median seconds and the floor."""
    base = preset(preset_name, smoke, arms=arms, seeds=(0,), workers=1, progress=False, out_dir=str(out_dir),
                  **({"policy": policy} if policy else {}), **(overrides or {}))
    start = starting_policy(base)
    shape = Shape.of(start)
    sequences = base.run.rollout.prompts_per_step * base.run.rollout.group_size
    rows = []
    for length in lengths:
        for arm in arms:
            run = dataclasses.replace(base.run_config(arm, 0, start), steps=steps, max_new_tokens=length,
                                      out_dir=str(out_dir / f"{arm}-L{length}"), checkpoint_every=steps,
                                      progress=False)
            if run_status(run) != "done":
                execute(run, 0.0, keep_checkpoints=False, first=True)
            metrics = pd.read_csv(Path(run.out_dir) / "metrics.csv")
            parts = breakdown(metrics, warmup)
            wide = metrics.pivot_table(index="step", columns="metric", values="value")
            sync_bytes = float(wide["sync_bytes"].median()) if "sync_bytes" in wide else 0.0
            floor = floors(shape, sequences, parts["length"], run.optim.epochs, parts["score"] > 0, sync_bytes, hbm,
                           flops)
            floor["step"] = sum(floor.values())
            for phase in (*PARTS, "step"):
                rows.append({"arm": arm, "max_new_tokens": length, "mean length": parts["length"], "phase": phase,
                             "measured s": parts[phase], "floor s": floor.get(phase, float("nan")),
                             "steps": parts["steps"]})
    table = pd.DataFrame(rows)
    table["x floor"] = (table["measured s"] / table["floor s"]).where(table["floor s"] > 0)
    return table


def markdown(table: pd.DataFrame, header: str) -> list[str]:
    def cell(v):
        return "—" if isinstance(v, float) and v != v else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = [header, "", "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="regime")
    p.add_argument("--policy", default="", help="the starting policy (e.g. a warm-started folder)")
    p.add_argument("--arms", nargs="+", default=["on", "off"], help="the arms (off: the same-run baseline)")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="default 512 1024 2048 (--smoke: 4)")
    p.add_argument("--steps", type=int, default=3, help="steps per run (medians over those after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hbm-bytes-s", type=float, default=HBM_BYTES_S)
    p.add_argument("--flops", type=float, default=BF16_FLOPS, help="dense bf16 FLOP/s")
    p.add_argument("--out-dir", default="runs/profile-regime")
    p.add_argument("--out", help="also write the table (markdown) to this file")
    p.add_argument("--smoke", action="store_true", help="a CPU check of the script: its numbers are no result")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="the preset's settings changed (e.g. max_tokens_per_microbatch=32768)")
    a = p.parse_args()
    lengths = tuple(a.lengths or ((4,) if a.smoke else (512, 1024, 2048)))
    table = profile(a.preset, a.smoke, a.policy, tuple(a.arms), lengths, a.steps, a.warmup, Path(a.out_dir),
                    a.hbm_bytes_s, a.flops, parse_overrides(a.set, OnOffConfig))
    header = (f"Regime step by phase: preset `{a.preset}`{' (smoke)' if a.smoke else ''}"
              f"{''.join(' ' + x for x in a.set)}, medians of steps after "
              f"{a.warmup}; floors at {a.hbm_bytes_s / 1e12:g} TB/s and {a.flops / 1e12:g} TFLOP/s (bench/"
              "profile_regime.py's docstring: decode bytes, 2N / 6N FLOPs a token)")
    emit(markdown(table, header), a.out)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        raise SystemExit(f"profile_regime: {e}") from None

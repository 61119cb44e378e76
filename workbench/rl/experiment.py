"""The ON/OFF experiment: the same GRPO runs with generator = trainer bitwise (`invariant`, ON)
and with the usual mismatched kernels (`standard`, OFF), over seeds, from one starting policy.

Each run is a `train()` in its own folder under out_dir; the combined long table (every run's
metrics, `variant` = kernel mode) is out_dir/metrics.csv. A run that finished is read back
instead of re-run, and one cut short resumes from its checkpoint, so an interrupted experiment
continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from ..config import check_at_least_one, write_config
from ..env import resolve_device
from .checkpoint import config_changes, latest_checkpoint
from .config import TrainConfig
from .policy import POLICY_SIZES, PolicyConfig, train_policy
from .trainer import train


@dataclass(frozen=True)
class OnOffConfig:
    policy: str = ""
    """Starting policy (registry name, folder, .gguf or hub id); empty: train one into out_dir/policy first."""
    policy_size: str = "tiny"
    """Size of the self-trained starting policy: 'tiny' (CPU) or 'small' (GPU)."""
    out_dir: str = "runs/on-off"
    """One folder per run below this, and the combined metrics.csv."""
    modes: tuple[str, ...] = ("invariant", "standard")
    """Kernel modes to compare."""
    seeds: tuple[int, ...] = (0,)
    """Seeds per mode (data order and sampling)."""
    steps: int = 3
    """GRPO steps per run."""
    prompts_per_step: int = 2
    """Prompts per step."""
    group_size: int = 4
    """Completions per prompt."""
    max_new_tokens: int = 4
    """Completion length limit."""
    lr: float = 1e-3
    """AdamW learning rate."""
    loss: str = "grpo"
    """grpo, dr_grpo, dapo or gspo."""
    mini_batches: int = 1
    """Optimizer steps per epoch over a step's sequences (PPO mini-batches)."""
    epochs: int = 1
    """Passes over a step's sequences."""
    old_logprobs: str = "recompute"
    """The PPO ratio's old policy: 'recompute' (the trainer's forward) or 'sampler' (the generator's log-probs)."""
    difficulty: int = 1
    """Arithmetic difficulty (of the starting policy's training and of the RL task)."""
    policy_steps: int = 400
    """Supervised steps at most for the self-trained starting policy."""
    policy_accuracy: tuple[float, float] = (0.1, 0.6)
    """The self-trained policy's supervised run stops once its greedy accuracy lies in this range."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto'."""
    tensorboard: bool = False
    """Also write each run's metrics to TensorBoard event files (in its folder's tensorboard/)."""
    progress: bool = True
    """Progress bars while training."""

    def __post_init__(self):
        if self.policy_size not in POLICY_SIZES:
            raise ValueError(f"unknown policy size {self.policy_size!r}; choose one of {sorted(POLICY_SIZES)}")
        bad = [m for m in self.modes if m not in ("invariant", "standard")]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty list of 'invariant' / 'standard', got {list(self.modes)}")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        check_at_least_one(self, "policy_steps")
        PolicyConfig(size=self.policy_size, target_accuracy=tuple(self.policy_accuracy), device="cpu")
        self.run_config("invariant", 0)  # the per-run settings are checked by TrainConfig itself

    def run_config(self, kernel_mode: str, seed: int, policy: str = "") -> TrainConfig:
        return TrainConfig(policy=policy or self.policy, out_dir=str(Path(self.out_dir) / f"{kernel_mode}-seed{seed}"),
                           kernel_mode=kernel_mode, task="arithmetic", difficulty=self.difficulty, loss=self.loss,
                           steps=self.steps, prompts_per_step=self.prompts_per_step, group_size=self.group_size,
                           max_new_tokens=self.max_new_tokens, lr=self.lr, mini_batches=self.mini_batches,
                           epochs=self.epochs, old_logprobs=self.old_logprobs, seed=seed, device=self.device,
                           checkpoint_every=max(1, self.steps // 4), tensorboard=self.tensorboard,
                           progress=self.progress)


def starting_policy(cfg: OnOffConfig) -> str:
    """The checkpoint every run starts from: cfg.policy, or one trained (once) into out_dir/policy.

    A policy already there is reused only if it was trained with the same settings.
    """
    if cfg.policy:
        return cfg.policy
    folder = Path(cfg.out_dir) / "policy"
    policy_cfg = PolicyConfig(size=cfg.policy_size, difficulty=cfg.difficulty, max_steps=cfg.policy_steps,
                              target_accuracy=tuple(cfg.policy_accuracy), device=resolve_device(cfg.device))
    wanted = {k: v for k, v in asdict(policy_cfg).items() if k != "device"}
    wanted["target_accuracy"] = list(wanted["target_accuracy"])
    record = folder / "policy_config.json"
    if (folder / "model.safetensors").exists():
        saved = json.loads(record.read_text()) if record.exists() else None
        if saved != wanted:
            raise ValueError(f"{folder} holds a starting policy trained with other settings ({saved}, now {wanted}); "
                             "use another out_dir or pass policy=...")
        return str(folder)
    _, _, table = train_policy(policy_cfg, folder)
    table.to_csv(folder / "sft_metrics.csv", index=False)
    record.write_text(json.dumps(wanted, indent=1))
    return str(folder)


def _finished(run: TrainConfig) -> pd.DataFrame | None:
    """The metrics of a run already complete in run.out_dir; a run there with other settings is an error."""
    folder = latest_checkpoint(Path(run.out_dir))
    if folder is None:
        return None
    saved = json.loads((folder / "state.json").read_text())
    changed = config_changes(saved["config"], run)
    if changed:
        raise ValueError(f"{run.out_dir} holds a run with other settings {changed} (saved, now); "
                         "use another out_dir for the experiment")
    return pd.read_csv(Path(run.out_dir) / "metrics.csv") if saved["step"] >= run.steps else None


def run_on_off(cfg: OnOffConfig) -> pd.DataFrame:
    """Every (mode, seed) run; returns the combined long table (also out_dir/metrics.csv)."""
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    write_config(cfg, Path(cfg.out_dir) / "config.yaml")
    policy = starting_policy(cfg)
    tables = []
    for seed in cfg.seeds:
        for kernel_mode in cfg.modes:
            run = cfg.run_config(kernel_mode, seed, policy)
            done = _finished(run)
            if done is None:
                resume = latest_checkpoint(Path(run.out_dir)) is not None
                done = train(dataclasses.replace(run, resume=resume))
            tables.append(done)
    table = pd.concat(tables, ignore_index=True)
    table.to_csv(Path(cfg.out_dir) / "metrics.csv", index=False)
    return table


def summarize_on_off(table: pd.DataFrame, window: int = 10) -> pd.DataFrame:
    """Per mode: runs, reward over the first and last `window` steps, parity, and step times.

    The window shrinks to half the run when the run is shorter than two windows (a run of one step
    has no gain: NaN). Times are medians over steps after the first (which includes compilation).
    """
    rows = []
    for variant, t in table.groupby("variant", sort=False):
        by = t.pivot_table(index=["seed", "step"], columns="metric", values="value")
        steps = by.index.get_level_values("step")
        w = min(window, (steps.max() - steps.min() + 1) // 2)
        first, last = by[steps <= steps.min() + w - 1], by[steps >= steps.max() - w + 1]
        warm = by[steps > steps.min()] if steps.max() > steps.min() else by
        def col(frame, name):  # a table without some metric (an older run) summarizes it as NaN
            return frame[name] if name in frame else pd.Series(float("nan"), index=frame.index)

        rows.append({
            "variant": variant,
            "runs": by.index.get_level_values("seed").nunique(),
            "steps": int(steps.max()),
            "reward_first": col(first, "reward_mean").mean() if w else float("nan"),
            "reward_last": col(last, "reward_mean").mean() if w else float("nan"),
            "reward_gain": col(last, "reward_mean").mean() - col(first, "reward_mean").mean() if w else float("nan"),
            "steps_with_differing_tokens": int((col(by, "parity_tokens_differing") > 0).sum()),
            "tokens_differing_total": col(by, "parity_tokens_differing").sum(),
            "parity_max_abs_diff": col(by, "parity_max_abs_diff").max(),
            "step_s_median": col(warm, "time_step").median(),
            "generate_s_median": col(warm, "time_generate").median(),
            "train_s_median": col(warm, "time_train").median(),
        })
    out = pd.DataFrame(rows)
    if {"invariant", "standard"} <= set(out.variant):
        ratio = (out.set_index("variant").loc["invariant", "step_s_median"]
                 / out.set_index("variant").loc["standard", "step_s_median"])
        out["step_time_vs_standard"] = out.step_s_median / out.set_index("variant").loc["standard", "step_s_median"]
        out.attrs["invariant_step_time_ratio"] = ratio
    return out


# The recorded GPU experiment's shape (BENCHMARKS.md): a starting policy at 20-50% greedy accuracy.
FULL = {"policy_size": "small", "difficulty": 1, "policy_steps": 2000, "policy_accuracy": (0.2, 0.5),
        "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 4, "lr": 3e-4, "steps": 100, "seeds": (0, 1, 2)}
# Seconds on a CPU: the tiny policy, two steps per mode.
SMOKE = {"policy_size": "tiny", "policy_steps": 100, "steps": 2, "seeds": (0,), "prompts_per_step": 2,
         "group_size": 4, "max_new_tokens": 4}


def preset(smoke: bool, device: str = "auto", out_dir: str = "runs/on-off", policy: str = "",
           progress: bool = True, tensorboard: bool = False) -> OnOffConfig:
    """The notebooks' and the nightly run's ON/OFF config: SMOKE (CPU, seconds) or FULL (a GPU)."""
    return OnOffConfig(out_dir=out_dir, policy=policy, device=device, progress=progress, tensorboard=tensorboard,
                       **(SMOKE if smoke else FULL))

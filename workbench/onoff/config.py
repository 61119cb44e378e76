"""`OnOffConfig`: one ON/OFF experiment (arms x seeds of one run config), and its presets.

A preset is a set of field values; `python -m workbench on-off --preset blog` starts from it, and a config file,
options and key=value overrides change it field by field. Every run's settings are a `TrainConfig` (`run`), so any
train setting can be set for an ON/OFF run, by its name or as run.<name>. `smoke=True` shrinks any preset to a CPU
check of the pipeline whose numbers are no result. The `blog` preset reproduces the vLLM + TorchTitan blog post's
experiment item for item: the table is in docs/onoff.md, "`workbench/onoff/config.py`: presets, and the blog recipe
item by item".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import check_at_least_one, flat_names, get_setting
from ..policies.selftrained import POLICY_SIZES, PolicyConfig
from ..rl.config import TrainConfig
from ..rl.losses import get_loss
from .arms import ARM_FIELDS, arm_settings
from .mps import wanted

SMOLLM2 = "smollm2-135m-instruct"
_RUN = TrainConfig(steps=3)


@flat_names
@dataclass(frozen=True)
class OnOffConfig:
    preset: str = ""
    """The preset these settings started from ('' for none; see PRESETS). Recorded, and used by the CLI."""
    smoke: bool = False
    """Shrink the preset to a CPU check of the pipeline (tiny self-trained policy on arithmetic, 2 steps, 1 seed)."""
    policy_size: str = "tiny"
    """Size of the self-trained starting policy: 'tiny' (CPU) or 'small' (GPU)."""
    policy_steps: int = 400
    """Supervised steps at most for the self-trained starting policy."""
    policy_accuracy: tuple[float, float] = (0.1, 0.6)
    """The self-trained policy's supervised run stops at its first greedy accuracy >= low (a warning if > high)."""
    out_dir: str = "runs/on-off"
    """One folder per run (<arm>-seed<seed>) below this, and the combined metrics.csv."""
    arms: tuple[str, ...] = ("on", "off")
    """Arms to run (see workbench.onoff.arms): on, off, off-recompute, off-tis, off-mis, off-vllm, on-vllm,
    noise=<sigma>."""
    seeds: tuple[int, ...] = (0,)
    """Seeds per arm (data order, sampling); an arm's runs and another's with the same seed see the same prompts."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps (0: four times per run)."""
    keep_checkpoints: bool = True
    """Keep a finished run's checkpoints (False deletes them once its metrics are recorded: 0.8 GB per run for
    SmolLM2 in bf16, ~30 GB at 1.7B with fp32 masters)."""
    workers: int = 1
    """Runs at once, each in its own process (a small policy leaves most of a GPU idle). Each process keeps its own
    CUDA memory cache: SmolLM2 runs took 4-16 GB each on the H100, and 11 at once ran out of its 80 GB."""
    mps: str = "auto"
    """workers > 1 on CUDA: run them under a CUDA MPS daemon of the call's own ('auto': where
    nvidia-cuda-mps-control exists, else time-sliced with a warning; 'on': required; 'off': never); a daemon the
    environment names (CUDA_MPS_PIPE_DIRECTORY) is joined, not started; onoff/mps.py."""
    time_limit_min: float = 0.0
    """Stop after this many minutes: running runs checkpoint at their next step boundary, the rest wait; the
    next call with the same out_dir continues (0: no limit)."""
    publish: str = ""
    """Also copy the report to <publish>/<date>_onoff-<preset>-<device>_<sha>/ (e.g. docs/results); the regime
    preset's as one arm record per arm (onoff/arm_records.py)."""
    run: TrainConfig = _RUN
    """Every run's settings (policy, task, loss, optimizer, device, ...: see TrainConfig), each settable by its
    name (lr=1e-5) or as run.<name>; the arm sets the generator's and the ratio's, the seed and out_dir the run's
    own. An empty policy: train one into out_dir/policy first."""

    def __post_init__(self):
        if self.policy_size not in POLICY_SIZES:
            raise ValueError(f"unknown policy size {self.policy_size!r}; choose one of {sorted(POLICY_SIZES)}")
        if not self.arms:
            raise ValueError("arms must name at least one arm (e.g. on, off)")
        if len(set(self.arms)) != len(self.arms) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"arms and seeds must not repeat: arms {list(self.arms)}, seeds {list(self.seeds)}")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed")
        if any(s < 0 for s in self.seeds):
            raise ValueError(f"seeds must be >= 0, got {list(self.seeds)}")
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.time_limit_min < 0:
            raise ValueError(f"time_limit_min must be >= 0, got {self.time_limit_min}")
        check_at_least_one(self, "policy_steps", "workers")
        wanted(self.mps, "cpu", 1)   # the setting's name
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0: four times per run), got {self.checkpoint_every}")
        PolicyConfig(size=self.policy_size, target_accuracy=tuple(self.policy_accuracy), device="cpu")
        for name in ("seed", *ARM_FIELDS):  # set per run: a value given for all runs would be dropped unseen
            if get_setting(self.run, name) != get_setting(_RUN, name):
                by, instead = ("seed", "seeds (e.g. seeds=[0,1])") if name == "seed" else ("arm", "arms")
                raise ValueError(f"{name} is set per run by its {by} (workbench.onoff.arms), not for all runs: "
                                 f"choose {instead}")
        for arm in self.arms:  # every run's settings, checked by TrainConfig itself before anything runs
            self.run_config(arm, self.seeds[0])

    def run_config(self, arm: str, seed: int, policy: str = "") -> TrainConfig:
        """The TrainConfig of one run: the shared settings (`run`), the arm's, and the seed."""
        return replace(self.run, policy=policy or self.run.policy, out_dir=f"{self.out_dir}/{arm}-seed{seed}",
                       seed=seed, checkpoint_every=self.checkpoint_every or max(1, self.run.steps // 4),
                       **arm_settings(arm, get_loss(self.run.objective.loss).sequence_level))


_BLOG = {"policy": SMOLLM2, "task": "facts", "chat_template": False, "prompts_per_step": 5, "group_size": 4,
         "max_new_tokens": 20, "temperature": 1.0, "loss": "blog", "lr": 1e-5, "weight_decay": 0.01,
         "max_grad_norm": 1.0, "master_dtype": "bfloat16", "steps": 100, "seeds": (0, 1, 2, 3, 4),
         "arms": ("on", "off", "off-recompute", "off-tis", "off-mis"), "keep_checkpoints": False, "workers": 5}
# The realistic task (tasks.ArithmeticChat: 23% sampled start accuracy for SmolLM2-135M-Instruct), GRPO with the
# trainer's micro-batches and PPO mini-batches. lr and clip are the blog recipe's, not tuned here.
_REALISTIC = {"policy": SMOLLM2, "task": "arithmetic-chat", "difficulty": 1, "chat_template": True,
              "prompts_per_step": 16, "group_size": 8, "max_new_tokens": 192, "temperature": 1.0, "loss": "grpo",
              "lr": 1e-5, "max_grad_norm": 1.0, "master_dtype": "float32", "mini_batches": 2, "steps": 100,
              "seeds": (0, 1, 2), "arms": ("on", "off", "off-tis"), "keep_checkpoints": False, "workers": 3}
# The regime map's cell: counting in steps (`tasks.counting`, answers sized to the length), GRPO-family with PPO
# mini-batches; 8 seeds: the map's verdicts are Holm-adjusted over its cells, and 3 lengths x 2 losses need
# 6 x 2/2^n <= 0.05 from the exact sign-flip test (n >= 8); lr and clip as `realistic`.
# SmolLM2-135M-Instruct starts near 0 on this task at T = 1 (docs/results/2026-11-27_offarm-probe-h100_8217c92):
# a run from it has nothing to learn; give it a policy warm-started on the task (`python -m workbench warm-start`,
# then policy=<its folder>).
# Its update runs one packed micro-batch a mini-batch with layer recompute: at the 135M shape a micro-batch's cost is
# its kernels' host work, not its tokens, and eight runs sharing a GPU need little activation memory each
# (the measurement: docs/results/2026-12-02_packed-microbatches-h200_6ebc574).
_REGIME = {**_REALISTIC, "task": "counting", "difficulty": 2, "prompts_per_step": 8, "max_new_tokens": 2048,
           "steps": 300, "seeds": tuple(range(8)), "arms": ("on", "off"), "workers": 2,
           "max_tokens_per_microbatch": 65536, "activation_checkpointing": "layers"}
PRESETS: dict[str, dict] = {
    # The self-trained 6-layer digit policy on bare arithmetic (the first ON/OFF experiment, docs/results).
    "digits": {"policy_size": "small", "difficulty": 1, "policy_steps": 2000, "policy_accuracy": (0.2, 0.5),
               "prompts_per_step": 32, "group_size": 8, "max_new_tokens": 4, "lr": 3e-4, "steps": 100,
               "seeds": (0, 1, 2)},
    "blog": _BLOG,
    # The dose-response on the blog recipe: the mismatch set by the sampler's logit noise and measured.
    "blog-dose": {**_BLOG, "seeds": (0, 1, 2),
                  "arms": ("on", "noise=0.01", "noise=0.03", "noise=0.1", "noise=0.3", "noise=1")},
    "realistic": _REALISTIC,
    # The long-horizon pair, where the literature sees collapse: 500 steps, the longest generations.
    "long": {**_REALISTIC, "arms": ("on", "off"), "seeds": (0,), "steps": 500, "max_new_tokens": 512, "workers": 2},
    # One cell of the regime map (`onoff.regime`): `on` vs the engine `off` on a task whose answer fills 3/4 of
    # max_new_tokens; the map sweeps max_new_tokens and the loss (REGIME_LENGTHS x REGIME_LOSSES).
    "regime": _REGIME,
}
SMOKE = {"policy": "", "policy_size": "tiny", "policy_steps": 100, "policy_accuracy": (0.1, 0.6), "task": "arithmetic",
         "difficulty": 1, "steps": 2, "seeds": (0,), "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4,
         "mini_batches": 1, "workers": 1, "device": "cpu"}
"""What `smoke` changes in any preset: seconds on a CPU. The tiny self-trained policy on its own bare arithmetic
(the facts' 44-token prompts cost the Triton interpreter over a minute a step), 2 x 2 sequences a step, and the
preset's first two arms (`on` and one other); its loss and optimizer stay, so its pipeline runs; the rewards mean
nothing."""


def preset_values(name: str, smoke: bool = False) -> dict:
    """The field values of preset `name` ('' for the defaults), shrunk by `smoke`."""
    if name and name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    values = {**PRESETS.get(name, {}), "preset": name, "smoke": smoke}
    if smoke:
        values.update(SMOKE)
        arms = tuple(values.get("arms", OnOffConfig.arms))
        # `on` and the first other arm: an invariant run costs the interpreter ~15 s (it scales with the sequences).
        values["arms"] = arms[:2]
    return values


def preset(name: str, smoke: bool = False, **overrides) -> OnOffConfig:
    """The config of preset `name` (shrunk by `smoke`), with `overrides` (the notebooks' parameters)."""
    return OnOffConfig(**{**preset_values(name, smoke), **overrides})


def preset_base(explicit: dict) -> dict:
    """For the CLI: the values of the preset (and smoke) that the explicitly given settings name."""
    if not explicit.get("preset") and not explicit.get("smoke"):
        return {}
    return preset_values(explicit.get("preset", ""), bool(explicit.get("smoke")))


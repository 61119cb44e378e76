# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · RL training, ON and OFF
#
# The experiment the workbench exists for: the same RL runs with generator = trainer bitwise (arm `on`)
# and with the usual mismatch (`off` and its variants), over seeds, from one starting policy. Every step
# measures the mismatch; in `on` a single differing token stops the run.
#
# The arms differ only in where the PPO ratio's "old" log-probs come from and what the update does with
# them (`workbench.onoff.arms`):
# - `off` (as TorchTitan's `simple_rl.py` and most vLLM-based trainers): old = the generator's log-probs,
#   so the kernel mismatch enters the ratio itself, and with it the clipping, from the first mini-batch on;
# - `off-recompute` (as verl and OpenRLHF): old = the trainer's own forward on the weights that sampled;
#   the mismatch stays out of the ratio and shows only in which tokens were sampled;
# - `off-tis`, `off-mis`: recomputed, plus truncated / masked importance weights pi_old / mu (cap 2);
# - `noise=S`: bitwise kernels, the sampler's logits perturbed by S x N(0, 1): a mismatch of chosen size,
#   measured like the kernels' (the dose-response).
# In `on` the sampler's and the trainer's log-probs are the same bits, so all of these coincide.
#
# Presets (`workbench.onoff.config`): `blog` (the vLLM + TorchTitan blog post's recipe, item for item, on
# SmolLM2-135M-Instruct), `blog-dose` (its dose-response), `realistic` (GRPO on chat arithmetic, 192
# tokens), `long` (500 steps), `digits` (the self-trained digit policy); `presets` names those to run.
# `smoke` shrinks each to seconds on a CPU (the tiny self-trained policy on its arithmetic, the first two
# arms, two steps): the pipeline runs, the numbers mean nothing. Each preset's full report (figures too):
# `python -m workbench on-off --preset ...`, or `workbench.onoff.publish.report(out_dir)`. The long
# metrics table of every preset goes to `run_dir/metrics/on_off.csv` (a `preset` column tells them
# apart); notebook 05 plots it. `settings` sets any experiment or train setting for every preset's runs,
# as on the command line (e.g. "kl_coef=0.05 clip_low=0.1 adapter=lora").

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
presets = "blog,blog-dose,realistic"
policy = ""
tensorboard = False
settings = ""

# %%
import pandas as pd

from workbench.config import parse_overrides
from workbench.onoff.config import OnOffConfig, preset
from workbench.onoff.runner import run_on_off
from workbench.onoff.stats import summarize, verdict
from workbench.tables import project_path, save_table

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
configs = {name: preset(name, smoke=smoke, device=device, out_dir=f"{run_dir}/work/on_off/{name}", progress=True,
                        tensorboard=tensorboard, **({"policy": policy} if policy else {}),
                        **parse_overrides(settings.split(), OnOffConfig))
           for name in presets.split(",")}
configs

# %% [markdown]
# Each preset trains (or reuses) its starting policy, then runs its arms x seeds; a progress bar shows each phase.

# %%
tables = []
for i, (name, cfg) in enumerate(configs.items(), 1):
    print(f"[{i}/{len(configs)}] preset {name}", flush=True)
    tables.append(run_on_off(cfg).assign(preset=name))
metrics = pd.concat(tables, ignore_index=True)
save_table(metrics, run_dir, "on_off")

# %% [markdown]
# The verdict per preset. Final reward is defined once (`workbench.onoff.stats.final_reward_words`): the mean reward
# over each run's last 10 steps, and in a run shorter than 20 steps (a smoke run) its second half, as the verdict
# says.

# %%
for name, table in zip(configs, tables):
    print(f"{name}:", verdict(summarize(table)), "\n")

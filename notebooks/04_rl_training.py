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
# The experiment the workbench exists for: the same GRPO runs on the synthetic arithmetic task,
# once with generator = trainer bitwise (`invariant`, ON) and once with the usual mismatched
# kernels (`standard`, OFF), over seeds. A small starting policy is trained first when none is
# given. Every step checks parity; in invariant mode a single differing token stops the run.
#
# Where the PPO ratio's "old" log-probs come from matters for what OFF means (`old_logprobs`):
# - `recompute` (the default, as verl and OpenRLHF do): the trainer's own forward on the weights that
#   sampled, before the first update. The ratio of the first mini-batch is exactly 1 in both modes; the
#   kernel mismatch stays out of the ratio and shows only as the sampler-trainer gap, which the
#   off-policy corrections (`correction`: TIS or masking) weigh.
# - `sampler` (as TorchTitan's `simple_rl.py` and most vLLM-based trainers use them): the generator's
#   log-probs. In `invariant` mode they are the same bits as `recompute`; in `standard` mode the mismatch
#   enters the ratio itself, and with it the clipping, from the first mini-batch on.
# With `mini_batches` > 1 (or `epochs` > 1) the ratio leaves 1 from the second mini-batch on and the clip
# fractions measure how far each update moved the policy.
#
# `smoke`: the tiny policy, two steps per mode (seconds on a CPU). Otherwise: the small policy,
# 100 steps x 3 seeds per mode (minutes on a GPU). The metrics table goes to
# `run_dir/metrics/on_off.csv`; notebook 05 plots it.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
policy = ""
tensorboard = False

# %%
from workbench.rl.experiment import preset, run_on_off, summarize_on_off
from workbench.tables import project_path, save_table

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
cfg = preset(smoke, device=device, out_dir=f"{run_dir}/work/on_off", policy=policy, progress=False,
             tensorboard=tensorboard)
cfg

# %%
metrics = run_on_off(cfg)
save_table(metrics, run_dir, "on_off")

# %%
summarize_on_off(metrics)

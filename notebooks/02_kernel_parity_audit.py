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
# # 02 · Kernel parity audit: every op, then the whole model
#
# For every op in the kernel registry and both modes, a row computed inside batches of M rows
# (at the first, middle and last position) is compared with the same row computed alone:
# bitwise equal or not, how many ulps apart, and the batch's error against an fp64 reference.
# `invariant` must be bitwise equal everywhere; `standard` shows where the usual kernels are not.
#
# Then the whole model: the trainer's forward (a sequence inside a batch) against the
# generator's decode step (batch 1 with a KV cache), op output by op output, under per-op mode
# overrides. The first op that differs is where generator and trainer part ways.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"

# %%
import torch

from workbench.audit import (
    AUDIT_FULL,
    AUDIT_SMOKE,
    DIVERGENCE_SETTINGS,
    audit_summary,
    divergence_sweep,
    kernel_audit,
)
from workbench.env import resolve_device
from workbench.models import build
from workbench.plots import audit_heatmap, save_figure
from workbench.tables import project_path, save_table

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
dev = resolve_device(device)
audit = kernel_audit(device=dev, **(AUDIT_SMOKE if smoke else AUDIT_FULL))
save_table(audit, run_dir, "kernel_audit")

# %%
audit_summary(audit)

# %%
heatmap = audit_heatmap(audit)
save_figure(heatmap, f"{run_dir}/figures", "kernel_audit")
heatmap

# %% [markdown]
# ## First divergence in the whole model
# A Qwen3-shaped model with random weights (`tiny` on a CPU, the 1.7B shape on a GPU). Each setting runs some
# ops in standard mode and the rest invariant; the table names the first op whose output differs
# between the trainer's forward and the generator's decode step.

# %%
model = build("tiny" if smoke else "qwen3-1.7B", device=dev, dtype=torch.bfloat16, seed=0)

# %%
settings = dict(list(DIVERGENCE_SETTINGS.items())[: 3 if smoke else None])
divergence = divergence_sweep(model, settings, seq_len=6 if smoke else 64, batch=3 if smoke else 16)
save_table(divergence, run_dir, "divergence")
divergence

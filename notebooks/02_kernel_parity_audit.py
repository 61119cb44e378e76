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
# **On a CPU** the bf16 standard ops at these small shapes may well agree bit for bit too, so the
# audit adds a control: the standard ops in **fp32** (`standard fp32`), where a CPU's BLAS (MKL
# here) may take another kernel and summation order for one row than for a batch, as cuBLAS does
# on a GPU. Its ulps are fp32 ulps. The first divergence gets the same control, and the published
# GPU results are shown below this run's, labelled as such.
#
# Then the whole model: the trainer's forward (a sequence inside a batch) against the
# generator's decode step (batch 1 with a KV cache), op output by op output, under per-op mode
# overrides. The first op that differs is where generator and trainer part ways.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"

# %%
# %matplotlib inline
import pandas as pd
import torch
from IPython.display import Markdown, display

from workbench.env import resolve_device
from workbench.models import build
from workbench.plots import audit_heatmap, save_figure
from workbench.published import published_nightly
from workbench.tables import project_path, save_table
from workbench.teach.audit import (
    AUDIT_FULL,
    AUDIT_SMOKE,
    DIVERGENCE_SETTINGS,
    audit_summary,
    divergence_sweep,
    kernel_audit,
)

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
dev = resolve_device(device)
shapes = AUDIT_SMOKE if smoke else AUDIT_FULL
audit = kernel_audit(device=dev, **shapes)
if dev == "cpu":  # the CPU's control: the standard ops in fp32 (see above)
    control = kernel_audit(device=dev, dtype=torch.float32, modes=("standard",), **shapes)
    audit = pd.concat([audit, control.assign(mode="standard fp32")], ignore_index=True)
save_table(audit, run_dir, "kernel_audit")

# %%
audit_summary(audit)

# %%
heatmap = audit_heatmap(audit, title=f"batch invariance per op on {'this CPU' if dev == 'cpu' else dev}",
                        note="standard fp32: the standard ops in fp32, the CPU's control (a CPU's BLAS may block "
                        "one row differently from a batch); the other columns are bf16" if dev == "cpu" else "")
save_figure(heatmap, f"{run_dir}/figures", "kernel_audit")
heatmap

# %% [markdown]
# ## Published audit (GPU)
# Shown when this machine has no GPU: the newest published full-scale nightly's audit (Qwen3-1.7B
# widths, batches up to 1024 rows) and its first divergence, read from `docs/results` as published. The heatmap
# is drawn again from the published tables, with that run's matmul batch variance (notebook 01's product) below.

# %%
published = published_nightly("kernel_audit") if dev == "cpu" else None
if published:
    display(Markdown(f"**{published.label}** (`{published.folder.name}`)"), audit_summary(published.table))
    matmul = published_nightly("batch_variance")  # notebook 01's product, where that run published it
    display(audit_heatmap(published.table, title=f"batch invariance per op, {published.label}",
                          matmul=matmul.table if matmul and matmul.folder == published.folder else None))

# %% [markdown]
# ## First divergence in the whole model
# A Qwen3-shaped model with random weights (`tiny` on a CPU, the 1.7B shape on a GPU). Each setting runs some
# ops in standard mode and the rest invariant; the table names the first op whose output differs
# between the trainer's forward and the generator's decode step.

# %%
model = build("tiny" if smoke else "qwen3-1.7B", device=dev, dtype=torch.bfloat16, seed=0)

# %%
settings = dict(list(DIVERGENCE_SETTINGS.items())[: 3 if smoke else None])
shape = dict(seq_len=6, batch=3) if smoke else dict(seq_len=64, batch=16)
divergence = divergence_sweep(model, settings, **shape)
if dev == "cpu":  # the CPU's control, as in the audit: the same model in fp32, every op standard
    model32 = build("tiny" if smoke else "qwen3-1.7B", device=dev, dtype=torch.float32, seed=0)
    control = divergence_sweep(model32, {"all standard, fp32 (CPU control)": {"default": "standard"}}, **shape)
    divergence = pd.concat([divergence, control], ignore_index=True)
save_table(divergence, run_dir, "divergence")
divergence

# %%
published = published_nightly("divergence") if dev == "cpu" else None
if published:
    display(Markdown(f"**First divergence, {published.label}** (`{published.folder.name}`, the 1.7B shape)"),
            published.table)

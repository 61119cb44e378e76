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
# # 05 · ON/OFF: reward, mismatch and dose-response
#
# Drawn only from a metrics table, so any run folder can be pointed at: this nightly run's (the default),
# or a published one (`docs/results/2026-11-23_onoff-blog-h100_1272149/metrics.csv.gz`, the
# dose-response in `..._onoff-blog-dose-h100_...`). Lines are the mean over seeds, bands the 95% bootstrap
# CI over seeds; the verdict is read off the same numbers. Figures are saved as SVG (for a blog post) and PNG.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
metrics = ""

# %%
from IPython.display import display

from workbench.onoff.figures import MISMATCH_PANELS, dose_response_figure, mismatch_panels, reward_curves
from workbench.onoff.stats import dose_response, summarize, verdict
from workbench.plots import save_figure
from workbench.tables import load_table, project_path

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
table = load_table(metrics or run_dir, "on_off")
groups = dict(iter(table.groupby("preset"))) if "preset" in table else {"": table}
window = 1 if smoke else 10
note = "smoke run: checks the pipeline, not a result" if smoke else ""

# %%
for name, t in groups.items():
    suffix = f"_{name}" if name else ""
    figure = reward_curves(t, smooth=1 if smoke else 5, title=f"{name or 'ON/OFF'}: reward", note=note)
    save_figure(figure, f"{run_dir}/figures", f"on_off{suffix}")
    display(figure)
    if t.metric.isin([name for name, _, _ in MISMATCH_PANELS]).any():  # an old table may hold rewards only
        figure = mismatch_panels(t)
        save_figure(figure, f"{run_dir}/figures", f"mismatch{suffix}")
        display(figure)

# %%
for name, t in groups.items():
    summary = summarize(t, window=window)
    print(name, verdict(summary), sep="\n")
    display(summary)

# %%
for name, t in groups.items():
    if t.variant.str.startswith("noise=").any():
        figure = dose_response_figure(dose_response(t, window=window))
        save_figure(figure, f"{run_dir}/figures", f"dose_response_{name}")
        display(figure)

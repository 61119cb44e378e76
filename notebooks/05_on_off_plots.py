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
# # 05 · ON/OFF: reward, entropy and mismatch curves
#
# Drawn only from a metrics table, so any run folder can be pointed at: this nightly run's
# (the default), an older one, or the committed H100 run
# (`docs/results/2026-11-21_onoff-h100_bd5150f/metrics.csv.gz`). Lines are the mean over seeds,
# bands span the seeds' min to max. Saved as SVG (for a blog post) and PNG.

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
metrics = ""

# %%
from workbench.plots import on_off_curves, save_figure
from workbench.rl.experiment import summarize_on_off
from workbench.tables import load_table, project_path

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %%
table = load_table(metrics or run_dir, "on_off")

# %%
seeds = table.seed.nunique()
note = (f"smoke run ({seeds} seed{'s' if seeds > 1 else ''}, {table.step.max()} steps): checks the pipeline, "
        "not a result" if smoke else f"{seeds} seeds; band: min to max over seeds")
figure = on_off_curves(table, smooth=1 if smoke else 5, title="GRPO on arithmetic: invariant (ON) vs standard (OFF)",
                       note=note)
save_figure(figure, f"{run_dir}/figures", "on_off")
figure

# %%
summarize_on_off(table)

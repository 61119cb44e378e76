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
# # 05 · ON/OFF: reward, mismatch, dose-response and the regime map
#
# Drawn only from a metrics table, so any run folder can be pointed at: this nightly run's (the default),
# or a published one (`docs/results/2026-11-23_onoff-blog-h100_1272149/metrics.csv.gz`, the
# dose-response in `..._onoff-blog-dose-h100_...`). Lines are the mean over seeds, bands a 95% BCa bootstrap
# CI over seeds (a display of spread). The verdict is calibrated: an arm is called higher or lower than `on`
# only when an exact sign-flip permutation test over seeds, Holm-adjusted over the arms, gives p <= 0.05 and
# the paired t-interval excludes 0. n seeds cannot give a p below 2/2^n, so fewer than 6 resolve nothing.
# Figures are saved as SVG (for a blog post) and PNG.
#
# **Without a GPU** the smoke rerun below checks the pipeline only, its numbers mean nothing, so the notebook
# first shows the newest published GPU results per preset from `docs/results` (figures and verdicts), each
# labelled "published, GPU, <device>, <date>".

# %% tags=["parameters"]
smoke = True
device = "auto"
run_dir = "runs/notebooks"
metrics = ""
published = "docs/results"

# %%
# %matplotlib inline
from IPython.display import Image, Markdown, display

from workbench.env import resolve_device
from workbench.onoff.comparison_figures import dose_response_figure, plan_curves, plan_map, plan_mismatch, regime_map
from workbench.onoff.figures import MISMATCH_PANELS, mismatch_panels, reward_curves
from workbench.onoff.publish import published_results
from workbench.onoff.regime_plan import assemble, map_table
from workbench.onoff.regime_record import GRID, map_message, published_arms
from workbench.onoff.stats import (
    CELL,
    FINAL_WINDOW,
    dose_response,
    dose_sentence,
    dose_slope,
    regime_table,
    summarize,
    verdict,
)
from workbench.plots import save_figure
from workbench.tables import load_table, project_path

run_dir = str(project_path(run_dir))  # against the project root, not the kernel's folder

# %% [markdown]
# ## Published results (GPU)
#
# Shown when this machine has no GPU: the newest published folder of each preset (a `regime` map first, when
# one is published), read from its `summary.md` and PNGs as published.

# %%
shown = published_results(published) if resolve_device(device) == "cpu" else []
for result in shown:
    display(Markdown(result.markdown))
    for path in result.figures:
        display(Markdown(f"*{path.stem}, {result.label}*"), Image(filename=str(path)))

# %% [markdown]
# ## The regime map, as pre-registered (published arms)
#
# The plan (`docs/results/2026-12-02_regime-plan`, written before any run) names its cells: a dose arm against `on`
# at one generation length and loss, each arm run alone (seeds 0-7, 300 steps) and published as a record of its
# own. The map is computed here from the arm records listed in `docs/results/index.json`, on any machine: per
# complete cell, final reward (steps 281-300) dose − `on` paired by seed, exact sign-flip p adjusted within the
# cell's family (Holm over its planned cells once all are tested; until then, an interim result, Bonferroni over
# them, which the final Holm cannot reverse), at the T x KL its dose runs measured; under it, every run of each cell
# over its steps (reward and the trainer's entropy), which the cell's one number averages. The grid below shows
# every planned cell and which of its arms are published.

# %%
arms = published_arms(published)
runs = assemble(arms)
plan = map_table(runs)
print(map_message(plan, len(arms)))
if plan.tested.any():
    for name, figure in (("plan_map", plan_map(plan)), ("plan_mismatch", plan_mismatch(plan)),
                         ("plan_curves", plan_curves(runs, plan))):
        save_figure(figure, f"{run_dir}/figures", name)
        display(figure)
    display(plan[plan.tested][["name", "t_x_kl", "d", "lo", "hi", "p", "p_holm", "family_in", "detectable",
                               "verdict"]])
display(plan[GRID])

# %% [markdown]
# ## This run

# %%
table = load_table(metrics or run_dir, "on_off")
groups = dict(iter(table.groupby("preset"))) if "preset" in table else {"": table}
window = FINAL_WINDOW  # final reward: `stats.final_reward_words` (the second half of a run shorter than 2 windows)
note = "smoke run: checks the pipeline, not a result" if smoke else ""

# %%
for name, t in groups.items():
    suffix = f"_{name}" if name else ""
    figure = reward_curves(t, smooth=1 if smoke else 5, title=f"{name or 'ON/OFF'}: reward", note=note)
    save_figure(figure, f"{run_dir}/figures", f"on_off{suffix}")
    display(figure)
    if t.metric.isin([name for name, _, _ in MISMATCH_PANELS]).any():  # an old table may hold rewards only
        figure = mismatch_panels(t, title=f"{name or 'ON/OFF'}: mismatch and update health")
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
        dose = dose_response(t, window=window)
        print(name, dose_sentence(dose_slope(dose)), sep="\n")
        figure = dose_response_figure(dose)
        save_figure(figure, f"{run_dir}/figures", f"dose_response_{name}")
        display(figure)

# %%
for name, t in groups.items():
    if set(CELL) <= set(t.columns):  # a regime experiment: runs across generation lengths and losses
        cells = regime_table(t, window=window)
        display(cells)
        figure = regime_map(cells)
        save_figure(figure, f"{run_dir}/figures", f"regime_map_{name}")
        display(figure)

"""The ON/OFF experiment: the same RL runs with the generator and trainer bitwise equal (`on`) and with
the usual mismatch (`off` and its corrected variants), over seeds; the mismatch measured at every step,
the rewards compared with confidence intervals, and the results published as a folder.

- `arms`: the named variants of a run; `config`: `OnOffConfig` and the presets (blog, realistic, ...);
- `runner`: runs resumable, in pieces, several at once; `stats`: endpoints, the verdict, the dose-response slope,
  the regime table; `paired`: the calibrated paired comparison (t-interval, exact sign-flip p, Holm);
- `figures`: plots as functions of the long table; `comparison_figures`: the dose-response and the regime map;
  `publish`: the results folder, and the published ones;
- `regime_plan`: the regime map as its pre-registered plan defines it, joined from arms published one at a time;
  `regime_record`: the map's record from the published arms (`python -m workbench regime-map`).
"""

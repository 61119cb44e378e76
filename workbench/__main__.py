"""Command line: `python -m workbench <command> [options]`; each command parses its config and calls a function."""

from __future__ import annotations

import argparse
import sys

from .config import add_arguments, from_namespace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from .demo import BatchVarianceConfig

    demo = sub.add_parser("demo", help="batch variance of a matmul: standard vs invariant, on this machine")
    add_arguments(demo, BatchVarianceConfig)

    from .rl.policy import PolicyConfig

    policy = sub.add_parser("train-policy", help="train the small starting policy on arithmetic and save it")
    add_arguments(policy, PolicyConfig)
    policy.add_argument("--out", default="runs/policy", help="checkpoint folder (default: runs/policy)")

    from .rl.trainer import TrainConfig

    trainer = sub.add_parser("train", help="GRPO-family training with a parity check every step")
    add_arguments(trainer, TrainConfig)

    args = parser.parse_args(argv)
    if args.command == "train":
        from .rl.trainer import train

        try:
            cfg = from_namespace(TrainConfig, args)
        except ValueError as e:
            trainer.error(str(e))
        table = train(cfg)
        last = table[table.step == table.step.max()].set_index("metric")["value"]
        print(last.to_string())
        print(f"metrics: {cfg.out_dir}/metrics.csv")
        return 0
    if args.command == "train-policy":
        from .rl.policy import train_policy

        try:
            cfg = from_namespace(PolicyConfig, args)
        except ValueError as e:
            policy.error(str(e))
        _, _, table = train_policy(cfg, args.out)
        acc = table[table.metric == "accuracy"]
        print(acc[["step", "value"]].rename(columns={"value": "greedy accuracy"}).to_string(index=False))
        print(f"saved to {args.out}")
        return 0
    if args.command == "demo":
        from .demo import batch_variance, resolve_device, summarize

        try:
            cfg = from_namespace(BatchVarianceConfig, args)
        except ValueError as e:
            demo.error(str(e))
        print(f"workbench demo on {resolve_device(cfg.device)}: row 0 of x[:M] @ W.T vs row 0 at M = 1 "
              f"(K={cfg.k}, N={cfg.n})", flush=True)
        table = batch_variance(cfg)
        print(table.to_string(index=False))
        print(summarize(table))
        if not table["invariant_bitwise_equal"].all():
            print("FAILED: the invariant kernel changed a row with the batch size", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())

"""Where a colocated 2-GPU step's extra time goes (run from the repo root on the 2-GPU host, after
bench/bench_distributed.py has saved its policy under runs/prof or with a fresh one):

    PYTHONPATH=$PWD python docs/results/2026-11-26_distributed-2xH200_d20d5c3/profile_per_rank.py one two

Each rank times, between torch.cuda.synchronize() calls, the data-parallel collectives and the trainer's `score`
(log-probs of the batch) and `update`, and prints the seconds of every call (step 1 included)."""
import collections
import os
import shutil
import sys
import time

sys.path.insert(0, "bench")
import torch

from workbench.distributed import launch


def _timed(owner, name, acc):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        acc[name].append(time.perf_counter() - t0)
        return r
    setattr(owner, name, wrapper)


def worker(cfg):
    import workbench.rl.trainer as tr
    from workbench.distributed.data_parallel import DataParallel

    acc = collections.defaultdict(list)
    for n in ("all_reduce_grads", "check_replicas", "gather_rows", "gather_objects", "ratio_of_sums", "sum", "max"):
        _timed(DataParallel, n, acc)
    for n in ("score", "update"):
        _timed(tr, n, acc)
    tr.train(cfg)
    print(f"rank {os.environ.get('RANK')}:", {k: [round(x, 3) for x in v][-6:] for k, v in acc.items()}, flush=True)


if __name__ == "__main__":
    import argparse
    import multiprocessing as mp

    import bench_distributed as bd

    args = argparse.Namespace(work="runs/prof", shape="qwen3-1.7B", device="cuda", prompts=32, group=8,
                              new_tokens=256, steps=3, microbatch_tokens=16384)
    policy = bd._policy(args)
    for name in sys.argv[1:]:
        world, cfg = bd._run_config(name, args, policy)
        shutil.rmtree(cfg.out_dir, ignore_errors=True)
        if world == 1:
            p = mp.get_context("spawn").Process(target=worker, args=(cfg,))
            p.start()
            p.join()
        else:
            launch.spawn(worker, world, cfg)

#!/usr/bin/env bash
# Session 2026-11-28 (d), one 4-GPU hold (issue 44 target 5): split roles with the parity check on a sample of the
# completions (TrainConfig.parity_sample = 8, bench --parity-sample 8) beside the fully checked runs, same hold.
# Started by device_onoff.sh STEP=job from a tree snapshot. 1-GPU runs side by side (one a GPU) with the trainer's
# GPU tests on GPU 3, then the 4-GPU runs one after another, the 4-GPU tests, the table.
set -u
R=/tmp/onoff
W=$R/bd4
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
B="python3 bench/bench_distributed.py --gpus 4 --work $W --parity-sample 8"
python3 -c "import sys, types; sys.path.insert(0, 'bench'); import bench_distributed as b; \
b._policy(types.SimpleNamespace(work='$W', shape='qwen3-1.7B'))"
CUDA_VISIBLE_DEVICES=0 $B --parts rl --runs one > $R/one.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 $B --parts rl --runs parity-128 > $R/parity128.log 2>&1 &
CUDA_VISIBLE_DEVICES=2 $B --parts rl --runs parity-126 > $R/parity126.log 2>&1 &
(CUDA_VISIBLE_DEVICES=3 timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_trainer.py \
  > $R/gpu_trainer.log 2>&1; echo "rc $?" >> $R/gpu_trainer.log) &
wait
for r in split-2r2t-async-check8 split-2r2t-async split-2r2t-sync-check8 split-1r3t-sync split-3r1t-sync; do
  timeout 400 $B --parts rl --runs $r > $R/$r.log 2>&1
  echo "$r rc $? $(date +%T)" >> $R/progress.log
done
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_distributed.py > $R/gpu_distributed.log 2>&1
echo "rc $?" >> $R/gpu_distributed.log
timeout 200 $B --parts rl --runs one split-2r2t-sync-check8 split-2r2t-async split-2r2t-async-check8 split-1r3t-sync \
  split-3r1t-sync parity-128 parity-126 --out $R/bench4.md > $R/table.log 2>&1
echo "all done $(date)" > $R/plan.done

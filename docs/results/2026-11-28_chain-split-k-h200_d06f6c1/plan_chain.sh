#!/usr/bin/env bash
# Session 2026-11-28 (c): issue 44 target 1 on the 4-GPU hold once the target-5 plan is done (main 17d2669 +
# chain-split-k d06f6c1): the chained decode products' GPU tests on GPU 0, the probe on GPU 1, side by side.
set -u
R=/tmp/onoff
while [ ! -f $R/plan.done ]; do sleep 3; done
export PYTHONUNBUFFERED=1
( CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_chain.py \
    tests/test_gpu_generation.py tests/test_gpu_lora.py > $R/chain_tests.log 2>&1; echo "rc $?" >> $R/chain_tests.log ) &
( CUDA_VISIBLE_DEVICES=1 timeout 400 python3 bench/probe_chain.py --out $R/probe_chain.md > $R/probe_chain.log 2>&1
  echo "rc $?" >> $R/probe_chain.log ) &
wait
echo "done $(date)" > $R/chain.done

#!/usr/bin/env bash
# Session 2026-11-28 (b) on one nvidia-h100-x2 hold, started by device_onoff.sh STEP=job from a tree snapshot:
# tensor parallelism's GPU tests on both GPUs, then one chain a GPU.
set -u
R=/tmp/onoff
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 WORKBENCH_GSM8K=/tmp/carry/gsm8k
# issue 43: tensor parallelism on the GPU, `train` included
timeout 600 python3 -m pytest -m gpu -x -q -s -p no:cacheprovider tests/test_gpu_titan_tp.py > $R/tp_tests.log 2>&1
echo "rc $?" >> $R/tp_tests.log
( export CUDA_VISIBLE_DEVICES=0       # issue 44 target 4 (time_score), then the trainer's GPU tests
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 600 python3 bench/bench_distributed.py --parts rl \
    --runs one --new-tokens 1024 --prompts 32 --group 8 --steps 4 --warmup 1 --no-keep-graphs --work $R/t4 \
    > $R/t4.log 2>&1
  python3 bench/step_breakdown.py $R/t4/one --out $R/t4_breakdown.md >> $R/t4.log 2>&1
  timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_trainer.py > $R/gpu_trainer.log 2>&1
  echo "rc $?" >> $R/gpu_trainer.log ) &
( export CUDA_VISIBLE_DEVICES=1       # target 4 on the real SmolLM2 (GSM8K), then target 2 (vLLM needed)
  while [ ! -f /tmp/carry/model.done ]; do sleep 5; done
  timeout 600 python3 -m workbench train --policy smollm2-135m-instruct --task gsm8k --prompts-per-step 32 \
    --group-size 8 --max-new-tokens 1024 --steps 5 --lr 1e-6 --kernel-mode invariant --device cuda \
    --checkpoint-every 1000000 --out-dir $R/smollm2-gsm8k --no-progress > $R/smollm2.log 2>&1
  python3 bench/step_breakdown.py $R/smollm2-gsm8k --out $R/smollm2_breakdown.md >> $R/smollm2.log 2>&1
  while [ ! -f /tmp/vllm/.done ]; do sleep 5; done
  PYTHONPATH=$PYTHONPATH:/tmp/vllm timeout 1100 python3 bench/bench_generate.py --long --vllm --out $R/long.md \
    > $R/long.log 2>&1 ) &
wait
echo "all done $(date)" > $R/plan.done

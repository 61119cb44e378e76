#!/usr/bin/env bash
# Session 2026-11-28 (c), one nvidia-h100-x1 hold, started by device_onoff.sh STEP=job from a tree snapshot of the
# branch t4 (main 6859adf + score-in-update c4e99df); plans/base is main 6859adf's workbench/ and bench/, the
# baseline: the same step with the separate scoring pass.
set -u
R=/tmp/onoff
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 WORKBENCH_GSM8K=/tmp/carry/gsm8k \
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T4="--parts rl --runs one --new-tokens 1024 --prompts 32 --group 8 --steps 4 --warmup 1 --no-keep-graphs"
SITE=${PYTHONPATH#*:}
timeout 600 python3 bench/bench_distributed.py $T4 --work $R/t4 > $R/t4.log 2>&1
python3 bench/step_breakdown.py $R/t4/one --out $R/t4_breakdown.md >> $R/t4.log 2>&1
( cd plans/base && PYTHONPATH=$PWD:$SITE timeout 600 python3 bench/bench_distributed.py $T4 --work $R/t4base \
    > $R/t4base.log 2>&1
  PYTHONPATH=$PWD:$SITE python3 bench/step_breakdown.py $R/t4base/one --out $R/t4base_breakdown.md >> $R/t4base.log 2>&1 )
timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_trainer.py > $R/gpu_trainer.log 2>&1
echo "rc $?" >> $R/gpu_trainer.log
while [ ! -f /tmp/carry/model.done ]; do sleep 5; done
timeout 600 python3 -m workbench train --policy smollm2-135m-instruct --task gsm8k --prompts-per-step 32 \
  --group-size 8 --max-new-tokens 1024 --steps 5 --lr 1e-6 --kernel-mode invariant --device cuda \
  --checkpoint-every 1000000 --out-dir $R/smollm2-gsm8k --no-progress > $R/smollm2.log 2>&1
python3 bench/step_breakdown.py $R/smollm2-gsm8k --out $R/smollm2_breakdown.md >> $R/smollm2.log 2>&1
echo "all done $(date)" > $R/plan.done

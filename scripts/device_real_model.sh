#!/usr/bin/env bash
# On the GPU machine (no network): the real SmolLM2-135M-Instruct from a GGUF carried in parts, then its
# GPU tests and benchmarks. Usage: GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf bash scripts/device_real_model.sh
# WHEELS=folder of wheels the host lacks (gguf); DATA=GSM8K test.jsonl; OUT=where tables and logs go.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-runs/device_real_model}"
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
t0=$(date +%s%N)
model=$(python3 -m workbench fetch-model smollm2-135m-instruct --source "$GGUF" | tail -1) || exit 1
echo "converted in $(( ($(date +%s%N) - t0) / 1000000 )) ms: $model"
t0=$(date +%s%N); python3 -m workbench fetch-model smollm2-135m-instruct >/dev/null
echo "second fetch (cached) in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
rc=0
# shellcheck disable=SC2086
python3 -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -25
rc=$((rc || PIPESTATUS[0]))
for b in ${BENCHES-parity generate load}; do
  case $b in
    parity) args=(--model "$model" --data "${DATA:-../shared/data/gsm8k/test.jsonl}") ;;
    generate) args=(--model "$model") ;;
    *) args=() ;;
  esac
  python3 "bench/bench_$b.py" "${args[@]}" --out "$out/bench_$b.md" > "$out/bench_$b.log" 2>&1 || rc=1
  cat "$out/bench_$b.md" 2>/dev/null || tail -30 "$out/bench_$b.log"
done
echo "rc=$rc"
exit $rc

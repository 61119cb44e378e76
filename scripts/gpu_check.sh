#!/usr/bin/env bash
# One call on the GPU machine: the `gpu` tests, then the benchmarks, then short tables.
# Usage (repo root, on a CUDA host with torch + triton + pytest):  bash scripts/gpu_check.sh
# A tree copied without .git can name its commit: WORKBENCH_GIT_SHA=<sha> bash scripts/gpu_check.sh
# BENCHES="generate" runs only bench/bench_generate.py, BENCHES="" none, BENCHES="vllm" the vLLM backends
# (default when unset: kernels model generate). The ON/OFF experiment: python -m workbench on-off --preset ...
# TESTS="tests/test_gpu_vllm.py" runs only those `gpu` tests, TESTS="" none (default: all of tests/).
# vLLM tests and benchmarks run where `import vllm` works (e.g. PYTHONPATH=/path/to/unpacked/vllm).
# tests/test_gpu_real_model.py needs SmolLM2 in the model cache: fetched where the package index is reachable,
# else skipped; on a host without network, scripts/device_real_model.sh converts a carried GGUF first.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-runs/gpu_check}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
tests_rc=0
if [ -n "${TESTS-tests}" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -m gpu ${TESTS-tests} -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -40
  tests_rc=${PIPESTATUS[0]}
fi
bench_rc=0
for b in ${BENCHES-kernels model generate}; do
  python3 "bench/bench_$b.py" --out "$out/bench_$b.md" > "$out/bench_$b.log" 2>&1 || bench_rc=1
  cat "$out/bench_$b.md" 2>/dev/null || tail -30 "$out/bench_$b.log"
done
echo "gpu tests rc=$tests_rc  bench rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]

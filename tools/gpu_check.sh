#!/usr/bin/env bash
# Runs fusec's GPU checks on a machine with an NVIDIA GPU and no Rust
# toolchain: the test binaries and the fusec binary are built elsewhere and
# placed in $BIN (default out/device). Writes logs under $OUT (default
# out/gpu-logs). Usage: tools/gpu_check.sh [tests|bench|all]
set -u
BIN=${BIN:-out/device}
OUT=${OUT:-out/gpu-logs}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export FUSEC_ROOT=$(pwd)
export FUSEC_CACHE_DIR=${FUSEC_CACHE_DIR:-/tmp/fusec-cache}
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in "$BIN"/gemm_gpu "$BIN"/step_gpu; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    timeout 300 "$t" --nocapture --test-threads=1 2>&1 | tee "$OUT/$(basename "$t").log" | grep -E "^test |test result|skipped|worst|loss|error|panicked" | head -60
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== fusec train gpt2-small (random batch)"
  timeout 300 "$BIN"/fusec train dsl-examples/gpt2-small.dsl --data random --batch 4 --seq 256 --steps 5 2>&1 | tail -8 | tee "$OUT/train.log"
  echo "== fusec bench gpt2-small B=8 T=1024"
  timeout 300 "$BIN"/fusec bench dsl-examples/gpt2-small.dsl --batch 8 --seq 1024 --steps 10 2>&1 | tail -3 | tee "$OUT/bench.log"
fi

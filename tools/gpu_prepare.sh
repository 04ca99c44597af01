#!/usr/bin/env bash
# Builds what tools/gpu_check.sh runs on a GPU machine into out/device: the
# release fusec binary, the GPU test executables and the PyTorch baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release
rm -rf out/device && mkdir -p out/device
cp target/release/fusec out/device/
# The runtime's own GPU tests, and those that drive it through the
# backends (in the fusec package).
for t in gemm_gpu:fusec-runtime flash_gpu:fusec-runtime step_gpu:fusec dp_gpu:fusec eval_cli:fusec generate_cli:fusec; do
  # The test target's own executable (the package's binary is listed too).
  exe=$(cargo test --release -p "${t#*:}" --test "${t%%:*}" --no-run --message-format=json 2>/dev/null \
    | grep "\"name\":\"${t%%:*}\"" | grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | tail -1)
  cp "$exe" "out/device/${t%%:*}"
done
# Drawn models for `gpu_check.sh zoo` (the model zoo test writes them as it
# checks them here).
FUSEC_ZOO_WRITE="$PWD/out/device/zoo" FUSEC_ZOO_SEEDS=${ZOO_SEEDS_DRAWN:-0..24} \
  cargo test --release --test model_zoo -q >/dev/null
for f in torch_reference.py torch_ddp.py hf_trainer_bert.py; do
  if [ -f ../shared/bench/$f ]; then cp ../shared/bench/$f out/device/; fi
done
du -sh out/device

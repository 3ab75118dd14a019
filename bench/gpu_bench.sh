#!/usr/bin/env bash
# Builds (unless prebuilt binaries are given), checks and times the GPU codec
# in one run on the GPU machine: test_gpu (GPU vs CPU reference, fresh seed)
# then gpu_bench (encode/decode GB/s vs device-to-device copy, same run),
# and with a calibration (kvcodec calibrate) gpu_bench_calibrated.
# Usage: bench/gpu_bench.sh [BIN_DIR] [KV_DUMP] [CAL.kvcal]   (BIN_DIR holds
# test_gpu, gpu_bench and gpu_bench_calibrated; without it, configures
# build-gpu-cuda with -DKVCODEC_CUDA=ON, which needs the CPU build's
# packages: Eigen, GTest, fmt, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-}
dump=${2:-../shared/models/tinycode/kv_dump.safetensors}
cal=${3:-}
if [ -z "$bin" ]; then
  cmake -S . -B build-gpu-cuda -DCMAKE_BUILD_TYPE=Release -DKVCODEC_CUDA=ON -DKVCODEC_BENCH=OFF >/dev/null
  cmake --build build-gpu-cuda --target test_gpu gpu_bench gpu_bench_calibrated -j"$(nproc)"
  bin=build-gpu-cuda/src/gpu
fi
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader || true
echo "== check: GPU against the CPU reference"
KVCODEC_GPU_TEST_SEED=${KVCODEC_GPU_TEST_SEED:-$RANDOM} KVCODEC_KV_DUMP="$dump" KVCODEC_GPU_CALIBRATION="$cal" \
  "$bin/test_gpu"
echo "== time: 32 layers x 8 kv heads x 16384 tokens x 128, bf16"
"$bin/gpu_bench" 32 8 16384 "$dump"
"$bin/gpu_bench" 32 8 16384
if [ -n "$cal" ]; then
  echo "== time: calibrated format, every layer of $cal x K/V x 21 rows x 16384 tokens, bf16"
  "$bin/gpu_bench_calibrated" "$cal" "$dump" 21 16384 4 128
fi

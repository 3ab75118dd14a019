#!/usr/bin/env bash
# The offload tier in one run on the GPU machine (docs/gpu.md): test_gpu with
# a fresh seed (the offload tier's tests included), offload_bench at each
# token count for Llama-3-8B's KV shape (32 layers x 8 KV heads x 128, bf16;
# sinks 4, window 8), then the recompute baseline (offload_recompute.py:
# torch + transformers prefill and one decode step).
# Usage: bench/offload_bench.sh BIN_DIR KV_DUMP CAL.kvcal [TOKENS=8192,32768]
# (BIN_DIR holds test_gpu and offload_bench, built with -DKVCODEC_CUDA=ON)
set -euo pipefail
bin=$1 dump=$2 cal=$3 tokens=${4:-8192,32768}
here=$(cd "$(dirname "$0")" && pwd)
status=0  # a failed check still lets the timings run; the exit status reports it
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader || true
echo "== check: GPU against the CPU reference"
KVCODEC_GPU_TEST_SEED=${KVCODEC_GPU_TEST_SEED:-$RANDOM} KVCODEC_KV_DUMP="$dump" KVCODEC_GPU_CALIBRATION="$cal" \
  "$bin/test_gpu" || status=1
echo "== offload tier: restore from compressed vs uncompressed pinned host copies"
"$bin/offload_bench" "$cal" "$dump" "$tokens" 32 8 4 8 || status=1
echo "== recompute: prefill and one decode step"
PYTHONUNBUFFERED=1 python3 "$here/offload_recompute.py" "$tokens" || status=1
exit $status

#!/usr/bin/env bash
# Rate-distortion sweep of kvtc on a KV dump: dp (beta model) and rate
# (one step, measured entropy) allocators over budgets, and the rate
# allocator at distortion targets, with the reverse water-filling bound.
# Usage: scripts/kvtc_sweep.sh [BUILD_DIR] [KV_DUMP] > docs/kvtc_rd_sweep.md
set -euo pipefail
build=${1:-build}
dump=${2:-../shared/models/tinycode/kv_dump.safetensors}
run() {  # label, then --set arguments
  local label=$1; shift
  "$build/kvcodec" bench --kv "$dump" --methods kvtc --repeats 1 --json "$@" 2>/dev/null |
    python3 -c '
import json, sys
r = json.load(sys.stdin)[0]
print("| %s | %.3f | %.5f | %.5f | %.3f | %.3f | %+.3f | %.3f | %.2f | %.3f |" % (sys.argv[1],
      r["compression_ratio"], r["rel_mse_key"], r["rel_mse_value"], r["bits_per_element"],
      r["payload_bits_per_element"], r["payload_bits_per_element"] - r["rd_bound_bits_per_element"],
      r["side_bits_per_element"], r["entropy_coding_gain"], r.get("attn_rel_err", float("nan"))))' "$label"
}
echo "| settings | ratio | rel_mse_key | rel_mse_value | bits/el | payload bits/el | payload - bound | side bits/el | entropy gain | attn_rel_err |"
echo "|---|---|---|---|---|---|---|---|---|---|"
for b in 32 64 96 128 160 192 256; do run "dp, bit_budget=$b" --set kvtc.bit_budget=$b; done
for b in 32 64 96 128 160 192 256; do run "rate, bit_budget=$b" --set kvtc.allocator=rate --set kvtc.bit_budget=$b; done
for t in 0.2 0.1 0.05 0.02 0.01 0.005 0.002; do
  run "rate, target_rel_mse=$t, basis_bits=8" --set kvtc.allocator=rate --set kvtc.target_rel_mse=$t --set kvtc.basis_bits=8
done
run "rate, target_rel_mse=0.01, basis_bits=16" --set kvtc.allocator=rate --set kvtc.target_rel_mse=0.01
run "rate, target_rel_mse=0.05, basis_bits=16" --set kvtc.allocator=rate --set kvtc.target_rel_mse=0.05

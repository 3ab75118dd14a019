#!/usr/bin/env bash
# kvcodec calibrate --cross-layer, then kvcodec eval --protocol prefix with the
# per-layer calibrated kvtc and the cross-layer store (xkvtc) on one short
# window of the shipped model, xkvtc streaming on another, and the errors of
# misuse (ctest: cli_stored_prefix).
# Usage: stored_prefix.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
tokens=$2/models/tinycode/eval_tokens.u16
if [ ! -f "$tokens" ]; then echo "SKIP: no eval tokens at $tokens"; exit 0; fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$kvcodec" calibrate --tokens "$tokens" --windows 3-3 --tokens-per-window 320 --threads 1 --cross-layer \
  --target-ratios 6,12 -o "$dir/xl{}.kvcal" > "$dir/calibrate.out" 2> "$dir/calibrate.err"
grep -q "cross-layer over 6 layers" "$dir/calibrate.out" || { echo "FAIL: $(cat "$dir/calibrate.out" "$dir/calibrate.err")" >&2; exit 1; }
out=$("$kvcodec" eval --tokens "$tokens" --windows 1 --context 257 --score 32 --threads 1 --json --protocol prefix \
        --methods fp16,xkvtc:a,xkvtc:b --set xkvtc:a.calibration="$dir/xl6.kvcal" --set xkvtc:b.calibration="$dir/xl12.kvcal")
python3 -c '
import json, sys
r = {m["method"]: m for m in json.loads(sys.argv[1])}
f, a, b = r["fp16"], r["xkvtc:a"], r["xkvtc:b"]
# 256 stored tokens, 6 layers, 2 x 128 values of 2 bytes each.
assert f["fp16_bytes"] == 256 * 6 * 2 * 128 * 2, f
assert a["fp16_bytes"] == f["fp16_bytes"], a
# The higher target stores fewer bytes and loses more; raw sinks alone cap the ratio at 64.
assert 2 < a["compression_ratio"] < b["compression_ratio"] < 64, (a, b)
assert 0 < a["kl"] < b["kl"], (a, b)
' "$out"
expect_error() {  # expect_error WORD ARGS...: the command fails naming WORD
  local word=$1; shift
  if "$kvcodec" "$@" > /dev/null 2> "$dir/err"; then echo "FAIL: accepted: $*" >&2; exit 1; fi
  grep -q -- "$word" "$dir/err" || { echo "FAIL: no '$word' in: $(cat "$dir/err")" >&2; exit 1; }
}
base=(eval --tokens "$tokens" --windows 1 --context 64 --score 8 --threads 1)
# Streaming, xkvtc is the per-layer caches of a sequence sharing one coder (cache/kvtc_crosslayer_stream.hpp).
out=$("$kvcodec" "${base[@]}" --json --methods fp16,xkvtc --set xkvtc.calibration="$dir/xl6.kvcal" --set xkvtc.window=8)
python3 -c '
import json, sys
r = {m["method"]: m for m in json.loads(sys.argv[1])}
x = r["xkvtc"]
assert x["fp16_bytes"] == r["fp16"]["fp16_bytes"] == 71 * 6 * 2 * 128 * 2, x  # 64 + 8 - 1 tokens held
assert 1.5 < x["compression_ratio"] and x["kl"] > 0, x
' "$out"
expect_error "xkvtc.scratch" "${base[@]}" --methods xkvtc --set xkvtc.calibration="$dir/xl6.kvcal" --set xkvtc.scratch=some
expect_error "xkvtc.calibration" "${base[@]}" --protocol prefix --methods xkvtc
expect_error "xkvtc.window" "${base[@]}" --protocol prefix --methods xkvtc --set xkvtc.calibration="$dir/xl6.kvcal" --set xkvtc.window=3
expect_error "streaming or prefix" "${base[@]}" --protocol stored --methods fp16
expect_error "whole_window" "${base[@]}" --protocol prefix --whole-window --methods fp16
# A per-layer calibration is not a cross-layer one, and the other way round.
expect_error "cross_layers=6" "${base[@]}" --protocol prefix --methods xkvtc --set xkvtc.calibration="$repo/models/tinycode/kvtc.kvcal"
expect_error "n_layers=1" "${base[@]}" --methods kvtc --set kvtc.calibration="$dir/xl6.kvcal"
echo PASS

#!/usr/bin/env bash
# kvcodec calibrate with the midtread quantizers and a refinement code, then
# kvcodec eval of a calibrated cache with and without kvtc.refine, on one
# short window of the shipped model (ctest: cli_calibrate_refine).
# Usage: calibrate_refine.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
tokens=$2/models/tinycode/eval_tokens.u16
if [ ! -f "$tokens" ]; then echo "SKIP: no eval tokens at $tokens"; exit 0; fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$kvcodec" calibrate --tokens "$tokens" --windows 3-4 --tokens-per-window 256 --threads 1 \
  --set kvtc.target_ratio=8 --set kvtc.refine_ratio=3 --set kvtc.sensitivity_windows=1 \
  -o "$dir/cal.kvcal" > "$dir/calibrate.out" 2> "$dir/calibrate.err"
grep -q "refinement layer 5" "$dir/calibrate.err" || { echo "FAIL: no refinement progress" >&2; cat "$dir/calibrate.err" >&2; exit 1; }
out=$("$kvcodec" eval --tokens "$tokens" --windows 1 --context 192 --score 64 --threads 1 --json \
        --methods fp16,kvtc:plain,kvtc:refined --set kvtc.calibration="$dir/cal.kvcal" --set kvtc.window=8 \
        --set kvtc:refined.refine=64)
python3 -c '
import json, sys
r = {m["method"]: m for m in json.loads(sys.argv[1])}
plain, refined = r["kvtc:plain"], r["kvtc:refined"]
# The refinement codes are stored and counted: a lower ratio than the plain
# cache of the same calibration, and a closer output distribution.
assert refined["compression_ratio"] < plain["compression_ratio"], (plain, refined)
assert refined["kl"] < plain["kl"], (plain, refined)
assert plain["compression_ratio"] > 3, plain
' "$out"
# refine needs a calibration with refinement parameters: refused, naming the fix.
"$kvcodec" calibrate --tokens "$tokens" --windows 3-3 --tokens-per-window 128 --threads 1 \
  --set kvtc.target_ratio=8 --set kvtc.sensitivity=none -o "$dir/plain.kvcal" > /dev/null 2>&1
if "$kvcodec" eval --tokens "$tokens" --windows 1 --context 64 --score 8 --threads 1 --methods kvtc \
     --set kvtc.calibration="$dir/plain.kvcal" --set kvtc.refine=16 2> "$dir/err"; then
  echo "FAIL: refine accepted without refinement parameters" >&2; exit 1; fi
grep -q "refine_ratio" "$dir/err" || { echo "FAIL: $(cat "$dir/err")" >&2; exit 1; }
echo PASS

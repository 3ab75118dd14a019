#!/usr/bin/env bash
# Regenerates docs/data/stored_prefix_s10.tsv, the stored-prefix table of
# docs/history/calibrated-sessions.md (issue 21): per-layer calibrated kvtc and the
# cross-layer store (xkvtc) under `kvcodec eval --protocol prefix`, settings
# chosen on windows 8-15, reported on windows 0-7 (context 1024, score 512),
# calibrations fitted on windows 16-31 (made here unless CAL_DIR has them).
# Usage: scripts/stored_prefix_figures.sh [BUILD_DIR (build)] [CAL_DIR (out)]
# Needs ../shared/models/tinycode/eval_tokens.u16. On the shared 2-core
# machine under load (8-13): ~25 min per calibration command, ~5-8 min per
# eval command (their CPU time: 2-3 min and ~1 min).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cal=${2:-out}
tokens=../shared/models/tinycode/eval_tokens.u16
mkdir -p "$cal"
[ -f "$cal/pl18.kvcal" ] || "$build/kvcodec" calibrate --tokens "$tokens" --windows 16-31 \
  --target-ratios 14,18 -o "$cal/pl{}.kvcal" --threads 1
[ -f "$cal/xl36.kvcal" ] || "$build/kvcodec" calibrate --tokens "$tokens" --windows 16-31 --cross-layer \
  --target-ratios 16,20,25,30,36 -o "$cal/xl{}.kvcal" --threads 1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
params=()
for first in 8 0; do
  "$build/kvcodec" eval --tokens "$tokens" --first-window $first --windows 8 --context 1024 --score 512 --threads 1 \
    --json --protocol prefix --methods fp16,kvtc:t12,kvtc:pl14,kvtc:pl18 \
    --set kvtc.window=0 --set kvtc.sinks=4 --set kvtc:t12.calibration=models/tinycode/kvtc.kvcal \
    --set kvtc:pl14.calibration="$cal/pl14.kvcal" --set kvtc:pl18.calibration="$cal/pl18.kvcal" > "$tmp/pl$first.json"
  xl=()
  for t in 16 20 25 30 36; do xl+=(--set "xkvtc:x$t.calibration=$cal/xl$t.kvcal"); done
  "$build/kvcodec" eval --tokens "$tokens" --first-window $first --windows 8 --context 1024 --score 512 --threads 1 \
    --json --protocol prefix --methods fp16,xkvtc:x16,xkvtc:x20,xkvtc:x25,xkvtc:x30,xkvtc:x36 "${xl[@]}" > "$tmp/xl$first.json"
done
params+=(--params kvtc:t12=models/tinycode/kvtc.kvcal --params "kvtc:pl14=$cal/pl14.kvcal" --params "kvtc:pl18=$cal/pl18.kvcal")
for t in 16 20 25 30 36; do params+=(--params "xkvtc:x$t=$cal/xl$t.kvcal"); done
python3 scripts/ratio_curve.py "${params[@]}" choose_8-15="$tmp/pl8.json" choose_8-15="$tmp/xl8.json" \
  report_0-7="$tmp/pl0.json" report_0-7="$tmp/xl0.json" > docs/data/stored_prefix_s10.tsv
echo "stored_prefix_figures.sh: wrote docs/data/stored_prefix_s10.tsv"

#!/usr/bin/env bash
# Regenerates docs/data/stream_crosslayer_s11.tsv, the streaming cross-layer
# table of docs/history/calibrated-sessions.md (issue 21): xkvtc under `kvcodec eval`'s
# streaming protocol (context 1024, score 512), settings chosen on windows
# 8-15 (one process; windows 16 and 8), reported on windows 0-7 (two processes of 4 windows,
# combined by scripts/combine_eval.py), calibrations fitted on windows 16-31
# (made here unless CAL_DIR has them; ~7 min wall at load 12 here).
# Usage: scripts/stream_crosslayer_figures.sh [BUILD_DIR (build)] [CAL_DIR (out)]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cal=${2:-out}
tokens=../shared/models/tinycode/eval_tokens.u16
mkdir -p "$cal"
[ -f "$cal/xl36.kvcal" ] || "$build/kvcodec" calibrate --tokens "$tokens" --windows 16-31 --cross-layer \
  --target-ratios 20,25,30,36 -o "$cal/xl{}.kvcal" --threads 1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The --set arguments of the listed xkvtc variants (xT: target T, xTw8: window 8,
# block 8), and the --methods list with fp16 first; eval refuses a --set of a
# variant it does not run.
variants() {
  methods=fp16 xl=()
  local m t
  for m in "$@"; do
    t=${m#x}; t=${t%w8}
    methods+=",xkvtc:$m"
    xl+=(--set "xkvtc:$m.calibration=$cal/xl$t.kvcal")
    [[ $m == *w8 ]] && xl+=(--set "xkvtc:$m.window=8" --set "xkvtc:$m.block=8")
  done
}
common=(--tokens "$tokens" --context 1024 --score 512 --json)
variants x25 x30 x36 x30w8 x36w8
"$build/kvcodec" eval "${common[@]}" --first-window 8 --windows 8 --threads 2 \
  --methods "$methods" "${xl[@]}" > "$tmp/choose.json"
variants x20 x25 x30 x36
for first in 0 4; do
  "$build/kvcodec" eval "${common[@]}" --first-window $first --windows 4 --threads 1 \
    --methods "$methods" "${xl[@]}" > "$tmp/report$first.json" &
done
wait
python3 scripts/combine_eval.py --windows-per-part 4 "$tmp/report0.json" "$tmp/report4.json" > "$tmp/report.json"
# One series per window setting (ratio_curve.py groups by the name before ':');
# the report windows run the window-16 series only (CPU time on this machine).
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
for run in ("choose", "report"):
    rows = json.load(open(f"{d}/{run}.json"))
    for tag, keep in (("w16", lambda m: m.startswith("xkvtc:") and not m.endswith("w8")),
                      ("w8", lambda m: m.endswith("w8")), ("other", lambda m: not m.startswith("xkvtc:"))):
        json.dump([r for r in rows if keep(r["method"])], open(f"{d}/{run}_{tag}.json", "w"))
PY
params=()
for t in 20 25 30 36; do params+=(--params "xkvtc:x$t=$cal/xl$t.kvcal"); done
for t in 30 36; do params+=(--params "xkvtc:x${t}w8=$cal/xl$t.kvcal"); done
python3 scripts/ratio_curve.py "${params[@]}" choose_8-15="$tmp/choose_other.json" \
  choose_8-15_w16="$tmp/choose_w16.json" choose_8-15_w8="$tmp/choose_w8.json" report_0-7="$tmp/report_other.json" \
  report_0-7_w16="$tmp/report_w16.json" > docs/data/stream_crosslayer_s11.tsv
echo "stream_crosslayer_figures.sh: wrote docs/data/stream_crosslayer_s11.tsv"

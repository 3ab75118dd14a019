#!/usr/bin/env bash
# Issue 21, session 16: KL sensitivities measured with the stream window in
# place (kvtc.sensitivity_window), with and without the recent tier. Makes
# the calibrations on windows 16-31, then runs scripts/issue21_grid.sh on
# windows 0-15 and pools them (docs/history/calibrated-sessions.md, docs/data/stream_windowed_s16.tsv).
# The sensitivities are measured at the middle target of each --target-ratios
# list (25 for xsw: the nine targets below, as in the published runs).
# Usage: KVCODEC=build/kvcodec TOKENS=../shared/models/tinycode/eval_tokens.u16 OUT=DIR [JOBS=$(nproc)] [THREADS=5] \
#        scripts/issue21_windowed.sh
set -euo pipefail
: "${KVCODEC:?}" "${TOKENS:?}" "${OUT:?}"
here=$(cd "$(dirname "$0")" && pwd)
cal=$OUT/cal
mkdir -p "$cal"
calibrate() {  # calibrate NAME TARGETS [--set ...]
  local name=$1 targets=$2
  shift 2
  "$KVCODEC" calibrate --tokens "$TOKENS" --windows 16-31 --cross-layer --set kvtc.sensitivity=kl "$@" \
    --target-ratios "$targets" -o "$cal/$name{}.kvcal" --threads "${THREADS:-5}" > "$OUT/cal_$name.log" 2>&1
}
calibrate xs 20,22,25 &
calibrate xsw 12,18,20,22,25,28,30,33,36 --set kvtc.sensitivity_window=16 --set kvtc.sensitivity_block=16 &
calibrate xs8w 18,20,22 --set kvtc.sensitivity_window=8 --set kvtc.sensitivity_block=8 &
wait
sha256sum "$cal"/*.kvcal > "$OUT/cal.sha256"
grid() {  # grid NAME KIND XPREFIX [VAR=VALUE ...]
  local name=$1 kind=$2 prefix=$3
  shift 3
  env KVCODEC="$KVCODEC" TOKENS="$TOKENS" CAL="$cal" JOBS="${JOBS:-$(nproc)}" RESULTS="$OUT/res_$name" KINDS="$kind" \
    XPREFIX="$prefix" "$@" bash "$here/issue21_grid.sh" > "$OUT/grid_$name.log"
}
grid a xa xs XA16="20 22 25 w20 w22 w25 w28" XA8="8w18 8w20 8w22"
grid r xr xsw XR="16:16:256:12:25,28,30,33,36 16:16:128:12:25,28,30,33,36 16:16:64:12:25,30,33"
mkdir -p "$OUT/all"
cp "$OUT"/res_a/*.json "$OUT/all/"
for f in "$OUT"/res_r/*.json; do cp "$f" "$OUT/all/r$(basename "$f")"; done
python3 "$here/combine_windows.py" "$OUT/all" 8 15 > "$OUT/choose_8-15.json"
python3 "$here/combine_windows.py" "$OUT/all" 0 7 > "$OUT/report_0-7.json"
python3 "$here/ratio_curve.py" choose="$OUT/choose_8-15.json" report="$OUT/report_0-7.json" | tee "$OUT/curves.tsv"
# The rows of docs/data/stream_windowed_s16.tsv (its columns), both window ranges.
python3 - "$OUT" > "$OUT/stream_windowed.tsv" <<'PY'
import json, sys
print("windows\tmethod\tratio\tppl\tppl_change_pct\tse_pct\tmin_pct\tmax_pct\tkl\ttop1")
for part in ("choose_8-15", "report_0-7"):
    for r in json.load(open(f"{sys.argv[1]}/{part}.json")):
        print("\t".join([part, r["method"], f"{r['compression_ratio']:.2f}", f"{r['ppl']:.4f}",
                         f"{r['ppl_change_pct']:+.3f}", f"{r['ppl_change_se_pct']:.2f}",
                         f"{r['ppl_change_min_pct']:+.2f}", f"{r['ppl_change_max_pct']:+.2f}",
                         f"{r['kl']:.4f}", f"{r['top1_agreement']:.4f}"]))
PY
echo "issue21_windowed: $OUT/stream_windowed.tsv, $OUT/curves.tsv"

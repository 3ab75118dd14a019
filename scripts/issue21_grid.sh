#!/usr/bin/env bash
# Issue 21's per-window grid: one `kvcodec eval` process per (window, job) on
# windows 0-15 of the shared corpus (context 1024, score 512, 1 thread each),
# JOBS at a time; windows 8-15 choose the settings, 0-7 report them
# (scripts/combine_windows.py, then scripts/ratio_curve.py). Jobs:
#   palu  fp16, int4 group 8, calibrated PALU (joint groups, Hadamard, groups
#         of 64 tokens) at energy 0.999 / 0.995 / 0.99      (CAL/joint.pcal)
#   xa    fp16, streaming xkvtc window 16 / block 16 at XA16 targets and
#         window 8 / block 8 at XA8 targets                 (CAL/<XPREFIX><t>.kvcal)
#   xb    streaming xkvtc window 4 / block 4 at XB4 targets
#   xw    streaming xkvtc at XW="W:B:t1,t2 ..." (window W, block B, targets)
#   xr    streaming xkvtc with a recent tier, XR="W:B:R:Q:t1,t2 ..." (the R newest
#         coded tokens at target Q's calibration, the rest at each target)
# Calibrations (fitted on windows 16-31):
#   kvcodec calibrate --cross-layer --target-ratios 18,20,22,25,28 -o 'CAL/xl{}.kvcal'
#   kvcodec calibrate --method palu --set palu.group_mode=joint --set palu.n_head_groups=1 -o CAL/joint.pcal
# (both with --tokens TOKENS --windows 16-31). Each process writes
# RESULTS/<job>_<window>.json and .err; progress lines go to stdout.
# Usage: KVCODEC=build/kvcodec TOKENS=../shared/models/tinycode/eval_tokens.u16 CAL=out RESULTS=DIR \
#        [JOBS=$(nproc)] [KINDS="xa palu xb"] [WINDOWS="0 ... 15"] [XPREFIX=xl] \
#        [XA16="20 22 25"] [XA8="18 20 22 25 28"] [XB4="18 20 22 25 28"] [XW=...] [XR=...] scripts/issue21_grid.sh
set -euo pipefail
: "${KVCODEC:?}" "${TOKENS:?}" "${CAL:?}" "${RESULTS:?}"
export KVCODEC TOKENS CAL RESULTS XPREFIX=${XPREFIX:-xl} XA16=${XA16-20 22 25} XA8=${XA8-18 20 22 25 28} \
  XB4=${XB4-18 20 22 25 28} XW=${XW-} XR=${XR-}
mkdir -p "$RESULTS"
run_one() {
  local kind=$1 w=$2 m set=() t e
  local common=(--tokens "$TOKENS" --first-window "$w" --windows 1 --context 1024 --score 512 --threads 1 --json)
  case $kind in
    palu)
      m=fp16,int4:g8; set=(--set int4:g8.group_size=8)
      for e in 999 995 99; do
        m+=",palu:e$e"
        set+=(--set "palu:e$e.calibration=$CAL/joint.pcal" --set "palu:e$e.group_size=64" --set "palu:e$e.hadamard=true"
              --set "palu:e$e.energy_threshold=0.$e")
      done ;;
    xa)
      m=fp16
      for t in $XA16; do m+=",xkvtc:w16t$t"; set+=(--set "xkvtc:w16t$t.calibration=$CAL/$XPREFIX$t.kvcal"); done
      for t in $XA8; do
        m+=",xkvtc:w8t$t"
        set+=(--set "xkvtc:w8t$t.calibration=$CAL/$XPREFIX$t.kvcal" --set "xkvtc:w8t$t.window=8" --set "xkvtc:w8t$t.block=8")
      done ;;
    xb)
      m=""
      for t in $XB4; do
        m+="${m:+,}xkvtc:w4t$t"
        set+=(--set "xkvtc:w4t$t.calibration=$CAL/$XPREFIX$t.kvcal" --set "xkvtc:w4t$t.window=4" --set "xkvtc:w4t$t.block=4")
      done ;;
    xw)  # XW="W:B:t1,t2 ...": window W, block B at each target
      m=""
      local spec W Bk ts
      for spec in $XW; do
        IFS=: read -r W Bk ts <<< "$spec"
        for t in ${ts//,/ }; do
          m+="${m:+,}xkvtc:w${W}b${Bk}t$t"
          set+=(--set "xkvtc:w${W}b${Bk}t$t.calibration=$CAL/$XPREFIX$t.kvcal" --set "xkvtc:w${W}b${Bk}t$t.window=$W"
                --set "xkvtc:w${W}b${Bk}t$t.block=$Bk")
        done
      done ;;
    xr)  # XR="W:B:R:Q:t1,t2 ...": window W, block B, recent tier of R tokens at target Q, base at each target
      m=""
      local spec W Bk Rr Q ts name
      for spec in $XR; do
        IFS=: read -r W Bk Rr Q ts <<< "$spec"
        for t in ${ts//,/ }; do
          name="xkvtc:w${W}b${Bk}r${Rr}q${Q}t$t"
          m+="${m:+,}$name"
          set+=(--set "$name.calibration=$CAL/$XPREFIX$t.kvcal" --set "$name.window=$W" --set "$name.block=$Bk"
                --set "$name.recent=$Rr" --set "$name.recent_calibration=$CAL/$XPREFIX$Q.kvcal")
        done
      done ;;
    *) echo "issue21_grid.sh: unknown job '$kind'" >&2; return 2 ;;
  esac
  local rc=0
  "$KVCODEC" eval "${common[@]}" --methods "$m" "${set[@]}" > "$RESULTS/${kind}_$w.json" 2> "$RESULTS/${kind}_$w.err" || rc=$?
  echo "$kind $w rc=$rc ${SECONDS}s"
  return $rc
}
export -f run_one
jobs=()
for k in ${KINDS:-xa palu xb}; do for w in ${WINDOWS:-$(seq 0 15)}; do jobs+=("$k $w"); done; done
printf '%s\n' "${jobs[@]}" | xargs -P "${JOBS:-$(nproc)}" -L 1 bash -c 'run_one "$0" "$1"'

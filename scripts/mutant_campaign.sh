#!/usr/bin/env bash
# Sealed-mutant campaigns of saved caches (docs/format.md), not run in CI:
#   1. in process: MUTANTS (default 100000) sealed mutants per method through
#      load_cache/load, then every read (Contract.SealedMutantsLoadOrFailCleanly
#      for fp16, int8, int4, kivi2, palu, kvtc local; CalibratedCache.
#      SealedCorruptionsFailCleanlyAndLeaveTheCache for calibrated kvtc with
#      refinement);
#   2. FILES (default 1000) mutants per method, each the one layer of a dump,
#      through `kvcodec decompress`: exit 0 (loaded) or 1 (an Error) pass;
#      anything else (a sanitizer report, a signal, 124 = over 20 s) is a crash
#      or a hang.
#   scripts/mutant_campaign.sh BUILD_DIR [MUTANTS] [FILES]
# BUILD_DIR should be a sanitizer build (e.g. build-fuzz or build-san).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: mutant_campaign.sh BUILD_DIR [MUTANTS] [FILES]}
mutants=${2:-100000}
files=${3:-1000}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-mutants.XXXXXX")
trap 'rm -rf "$work"' EXIT
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "== in process: $mutants sealed mutants per method"
KVCODEC_MUTANTS=$mutants KVCODEC_MUTANT_DIR="$work" KVCODEC_MUTANT_FILES=$files \
  "$build/src/cache/test_cache" \
  --gtest_filter='AllMethods/Contract.SealedMutantsLoadOrFailCleanly/*_B1:CalibratedCache.SealedCorruptionsFailCleanlyAndLeaveTheCache' \
  2>&1 | grep -E "sealed|OK|FAILED|ERROR|Sanitizer|runtime error" | tee "$work/inprocess.log"
inproc_rc=${PIPESTATUS[0]}
echo "in-process rc: $inproc_rc"

echo "== kvcodec decompress: $files mutants per method"
crashes=0
for method in fp16 int8 int4 kivi2 palu kvtc kvtc_calibrated; do
  ok=0 refused=0 bad=0
  for f in "$work/${method}"_[0-9]*.kvc; do
    [ -e "$f" ] || continue
    timeout 20 "$build/kvcodec" decompress "$f" -o "$work/out.safetensors" >/dev/null 2>"$work/err"
    rc=$?
    case $rc in
      0) ok=$((ok + 1)) ;;
      1) refused=$((refused + 1)) ;;
      *) bad=$((bad + 1)); cp "$f" "$work/../crash_$(basename "$f")" 2>/dev/null
         echo "  CRASH/HANG rc $rc on $f:"; tail -n 5 "$work/err" ;;
    esac
  done
  echo "  $method: $((ok + refused + bad)) files, $ok loaded, $refused refused (Error), $bad crashes or hangs"
  crashes=$((crashes + bad))
done
[ "$inproc_rc" -eq 0 ] && [ "$crashes" -eq 0 ]

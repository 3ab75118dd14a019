#!/usr/bin/env bash
# Long fuzz and sealed-mutant campaigns on a many-core machine that has no
# build tools or Debian libraries (docs/caches.md, "Fuzzing"). Two steps:
#
#   scripts/fuzz_campaign.sh pack BUILD_DIR BUNDLE
#     here: copies BUILD_DIR's sanitizer executables (fuzz/fuzz_*, kvcodec,
#     src/cache/test_cache), the shared libraries they load (ldd, glibc
#     excepted), each target's seeds (fuzz/corpus/<t>, the seeds the target
#     writes itself, the golden saved caches), its kept crash inputs, the
#     tinycode config.json and tokenizer.json and this script into BUNDLE.
#     BUILD_DIR: a clang build with -DKVCODEC_FUZZ=ON -DKVCODEC_TESTS=ON.
#
#   BUNDLE/fuzz_campaign.sh run BUNDLE SECONDS OUT [CORES]
#     there: every fuzz target on its share of CORES (default nproc, at
#     least one process each; WEIGHTS below) for SECONDS, beside the sealed-mutant
#     campaign of scripts/mutant_campaign.sh (MUTANTS=100000 in process per
#     method, FILES=1000 per method through `kvcodec decompress`; env
#     overrides; MUTANTS=0 skips it). MAX_LEN (default 4096): -max_len.
#     MUTANT_COUNTS="fp16=0" sets a method's count apart (0: only the
#     decompress files). SHARDS="kvtc=8 palu=4" splits a method's count over that many
#     processes (other mutants: KVCODEC_MUTANT_SEED = shard; default 1).
#     WEIGHTS="fuzz_tokenizer=8 fuzz_entropy=3" gives a target that many
#     shares of the fuzzing cores (default 1 each). FUZZ_CORES (default
#     CORES): the cores the fuzzers share.
#     Logs, counts and any crash input go to OUT; the last lines printed are
#     the counts per target (libFuzzer's "Done N runs", summed over processes).
set -uo pipefail

pack() {
  local build=$1 bundle=$2 root
  root=$(cd "$(dirname "$0")/.." && pwd)
  rm -rf "$bundle"
  mkdir -p "$bundle"/{bin,lib,corpus,regressions,model}
  cp "$build"/fuzz/fuzz_* "$build/kvcodec" "$build/src/cache/test_cache" "$bundle/bin/"
  # No line tables (the other machine has no symbolizer): reports give
  # module+offset, which llvm-symbolizer resolves here against BUILD_DIR.
  strip --strip-debug "$bundle"/bin/*
  # Every library but glibc's own: the other machine may have none of them.
  ldd "$bundle"/bin/* | awk '/=> \//{print $3}' | sort -u |
    grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so' | xargs -r cp -L -t "$bundle/lib/"
  cp "$root/models/tinycode/config.json" "$root/models/tinycode/tokenizer.json" "$bundle/model/"
  for exe in "$bundle"/bin/fuzz_*; do
    local t
    t=$(basename "$exe")
    mkdir -p "$bundle/corpus/$t"
    [ -d "$root/fuzz/corpus/$t" ] && cp -r "$root/fuzz/corpus/$t/." "$bundle/corpus/$t/"
    [ "$t" = fuzz_cache_load ] && cp "$root"/tests/data/saved_caches/*.kvc "$bundle/corpus/$t/"
    [ -d "$root/fuzz/regressions/$t" ] && cp -r "$root/fuzz/regressions/$t" "$bundle/regressions/"
    mkdir -p "$bundle/empty"
    (cd "$root" && KVCODEC_FUZZ_SEEDS="$bundle/corpus/$t" "$exe" -runs=0 "$bundle/empty" >/dev/null 2>&1) || true
  done
  rmdir "$bundle/empty"
  cp "$0" "$bundle/fuzz_campaign.sh"
  du -sh "$bundle"
}

# weight_of NAME "a=2 b=3" [DEFAULT]: NAME's number in the list, else DEFAULT (1).
weight_of() {
  local kv
  for kv in $2; do
    [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }
  done
  echo "${3:-1}"
}

# mutants OUT: the sealed-mutant campaign, SHARDS processes per method.
mutants() {
  local out=$1 bin=$bundle/bin m
  local n=${MUTANTS:-100000} files=${FILES:-1000}
  local work=$out/mutants
  local pids=()
  mkdir -p "$work"
  for m in fp16 int8 int4 kivi2 palu kvtc kvtc_calibrated; do
    local filter="AllMethods/Contract.SealedMutantsLoadOrFailCleanly/${m}_B1"
    [ "$m" = kvtc_calibrated ] && filter='CalibratedCache.SealedCorruptionsFailCleanlyAndLeaveTheCache'
    local shards s dir count
    shards=$(weight_of "$m" "${SHARDS:-}")
    count=$(weight_of "$m" "${MUTANT_COUNTS:-}" "$n")
    for ((s = 0; s < shards; ++s)); do
      dir=""  # shard 0 alone writes the files for the decompress step
      [ "$s" = 0 ] && dir=$work
      KVCODEC_MUTANTS=$(( (count + shards - 1) / shards )) KVCODEC_MUTANT_SEED=$s KVCODEC_MUTANT_DIR="$dir" \
        KVCODEC_MUTANT_FILES=$files "$bin/test_cache" --gtest_filter="$filter" >"$out/inprocess_$m.$s.log" 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"  # not the fuzzers running beside
  echo "== in process (about $n sealed mutants per method, over its shards)"
  for m in fp16 int8 int4 kivi2 palu kvtc kvtc_calibrated; do
    local logs=("$out/inprocess_$m".*.log) passed
    passed=$(grep -lE '^\[  PASSED  \] 1 test' "${logs[@]}" | wc -l)
    echo "  $m: ${#logs[@]} shards, $passed passed; $(grep -hE 'sealed (mutants|corruptions)' "${logs[@]}" | tr '\n' ' ')"
    [ "$passed" = "${#logs[@]}" ] || echo "  $m: FAILED (see inprocess_$m.*.log)"
  done
  echo "== kvcodec decompress ($files mutants per method)"
  # One process per file: rc 0 (loaded) or 1 (an Error) pass; anything else
  # (a sanitizer report, a signal, 124 = over 20 s) is a crash or a hang.
  ls "$work"/*.kvc | xargs -P "$cores" -I{} sh -c \
    'timeout 20 "$0" decompress "$1" -o "$1.st" >/dev/null 2>"$1.err"; rc=$?; rm -f "$1.st"; echo "$rc $1"' \
    "$bin/kvcodec" {} >"$out/decompress_rc.txt"
  for m in fp16 int8 int4 kivi2 palu kvtc kvtc_calibrated; do
    awk -v m="$m" '{ n = $2; sub(/.*\//, "", n); sub(/_[0-9]+\.kvc$/, "", n); if (n != m) next;
                     t++; if ($1 == 0) ok++; else if ($1 == 1) ref++; else bad++ }
                   END { printf "  %s: %d files, %d loaded, %d refused (Error), %d crashes or hangs\n", m, t, ok, ref, bad }' \
      "$out/decompress_rc.txt"
  done
  awk '$1 != 0 && $1 != 1 {print $2}' "$out/decompress_rc.txt" | while read -r f; do
    cp "$f" "$f.err" "$out/" 2>/dev/null
  done
}

# fuzz OUT UNTIL: every target on cores/targets processes until time UNTIL.
fuzz() {
  local out=$1 until=$2 bin=$bundle/bin t
  local targets=() exe
  for exe in "$bin"/fuzz_*; do [ -e "$exe" ] && targets+=("$(basename "$exe")"); done
  # A bundle without fuzz targets (a mutant-only campaign) fuzzes nothing.
  [ ${#targets[@]} = 0 ] && { echo "== no fuzz targets in $bin"; return 0; }
  local fuzz_cores=${FUZZ_CORES:-$cores} shares=0 per
  for t in "${targets[@]}"; do shares=$(( shares + $(weight_of "$t" "${WEIGHTS:-}") )); done
  local secs=$(( until - $(date +%s) ))
  [ "$secs" -lt 5 ] && secs=5
  echo "== fuzzing ${#targets[@]} targets on $fuzz_cores cores by weight (${WEIGHTS:-equal}), ${secs}s"
  mkdir -p "$out/crashes"
  for t in "${targets[@]}"; do
    local corpus=$out/corpus_$t
    mkdir -p "$corpus"
    cp -r "$bundle/corpus/$t/." "$corpus/"
    if [ -d "$bundle/regressions/$t" ]; then
      "$bin/$t" "$bundle/regressions/$t"/* >"$out/$t.regressions.log" 2>&1 ||
        echo "  $t FAILS a kept regression input"
    fi
    per=$(( fuzz_cores * $(weight_of "$t" "${WEIGHTS:-}") / shares ))
    [ "$per" -lt 1 ] && per=1
    for ((p = 0; p < per; ++p)); do
      ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$bin/$t" "$corpus" -max_total_time="$secs" -max_len="${MAX_LEN:-4096}" -seed=$((1000 + p)) \
          -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
          -artifact_prefix="$out/crashes/$t-" >"$out/$t.$p.log" 2>&1 &
    done
  done
  wait
  echo "== executions per target (libFuzzer 'Done N runs', summed over processes)"
  for t in "${targets[@]}"; do
    local runs fails
    runs=$(grep -hoE '^Done [0-9]+ runs' "$out/$t".[0-9]*.log | awk '{s += $2} END {print s + 0}')
    fails=$(grep -LE '^Done [0-9]+ runs' "$out/$t".[0-9]*.log | wc -l)
    echo "  $t: $runs runs in $(ls "$out/$t".[0-9]*.log | wc -l) processes, $fails ended without 'Done' (a finding: see $t.*.log)"
  done
  ls "$out/crashes" | head -20
}

case ${1:-} in
  pack) pack "${2:?BUILD_DIR}" "${3:?BUNDLE}" ;;
  run)
    bundle=$(cd "${2:?BUNDLE}" && pwd)
    total=${3:?SECONDS}
    out=${4:?OUT}
    cores=${5:-$(nproc)}
    start=$(date +%s)
    mkdir -p "$out"
    export LD_LIBRARY_PATH=$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export KVCODEC_MODEL=$bundle/model
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    # The fuzzers run beside the mutant campaign, which starts 7 processes
    # and then one decompress process per core.
    fuzz "$out" $(( start + total )) >"$out/fuzz_summary.txt" &
    fuzzing=$!
    [ "${MUTANTS:-1}" != 0 ] && mutants "$out"
    wait "$fuzzing"
    cat "$out/fuzz_summary.txt"
    ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac

#!/usr/bin/env bash
# Builds every libFuzzer target (fuzz/fuzz_*.cpp) with clang, replays each
# one's kept crash inputs (fuzz/regressions/<target>/*), then runs it on a copy
# of its seed corpus: fuzz/corpus/<target>/, the seeds the target makes itself
# (KVCODEC_FUZZ_SEEDS, see fuzz/fuzz_seeds.hpp) and, for the cache loader,
# tests/data/saved_caches/. The fuzz executables verify no container checksum
# (fuzz/CMakeLists.txt), so mutations reach the parsers behind them.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# SECONDS (default 60) is the total budget, split evenly over the targets
# (at least 1 s each). Fails if any target crashes, leaks, times out or runs
# out of memory; the reproducer is kept under $KVCODEC_FUZZ_ARTIFACTS
# (default build-fuzz/artifacts). Other knobs: KVCODEC_FUZZ_BUILD_DIR,
# KVCODEC_FUZZ_MAX_LEN (default 65536), KVCODEC_FUZZ_JOBS (build jobs).
set -euo pipefail
cd "$(dirname "$0")/.."

total=${1:-60}
shift || true
build=${KVCODEC_FUZZ_BUILD_DIR:-build-fuzz}
max_len=${KVCODEC_FUZZ_MAX_LEN:-65536}
artifacts=${KVCODEC_FUZZ_ARTIFACTS:-$build/artifacts}
jobs=${KVCODEC_FUZZ_JOBS:-$(nproc)}

if ! [[ "$total" =~ ^[0-9]+$ ]]; then
  echo "fuzz.sh: SECONDS must be a whole number, got '$total'" >&2
  exit 2
fi

if [ $# -gt 0 ]; then
  targets=("$@")
else
  targets=()
  for src in fuzz/fuzz_*.cpp; do
    [ -e "$src" ] || continue
    name=$(basename "$src" .cpp)
    targets+=("$name")
  done
fi
if [ ${#targets[@]} -eq 0 ]; then
  echo "fuzz.sh: no fuzz/fuzz_*.cpp targets" >&2
  exit 0
fi

# A build folder already configured for fuzzing (scripts/test.sh's sanitizer
# build) is reused as it is; otherwise configure a fuzz-only one.
if grep -q '^KVCODEC_FUZZ:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "fuzz.sh: reusing $build (targets: ${targets[*]})"
else
  echo "fuzz.sh: configuring $build with clang (targets: ${targets[*]})"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER=clang++ \
    -DKVCODEC_FUZZ=ON -DKVCODEC_TESTS=OFF -DKVCODEC_BENCH=OFF >/dev/null
fi
# Only the fuzz targets (and the libraries they link), not the whole tree.
cmake --build "$build" -j"$jobs" --target "${targets[@]}"

per=$(( total / ${#targets[@]} ))
[ "$per" -lt 1 ] && per=1
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"

failed=()
for t in "${targets[@]}"; do
  corpus="$work/$t"
  mkdir -p "$corpus"
  # A copy, so the checked-in seeds never grow with generated inputs.
  if [ -d "fuzz/corpus/$t" ]; then
    cp -r "fuzz/corpus/$t/." "$corpus/"
  else
    echo "fuzz.sh: $t has no fuzz/corpus/$t (seeds from the target itself only)"
  fi
  # Saved caches of every method (golden files checked by test_cache) seed
  # the cache loader: the fuzzer starts from valid files of each layout.
  if [ "$t" = fuzz_cache_load ] && [ -d tests/data/saved_caches ]; then
    cp tests/data/saved_caches/*.kvc "$corpus/"
  fi
  mkdir -p "$work/empty"
  KVCODEC_FUZZ_SEEDS="$corpus" "$build/fuzz/$t" -runs=0 "$work/empty" >/dev/null 2>&1 || true
  if [ -d "fuzz/regressions/$t" ] && ls "fuzz/regressions/$t"/* >/dev/null 2>&1; then
    if ! "$build/fuzz/$t" fuzz/regressions/"$t"/* >"$work/$t.regressions.log" 2>&1; then
      tail -n 40 "$work/$t.regressions.log" >&2
      echo "fuzz.sh: $t fails on a kept regression input (fuzz/regressions/$t/)" >&2
      failed+=("$t")
      continue
    fi
    echo "  $t: $(ls fuzz/regressions/"$t" | wc -l) regression inputs pass"
  fi
  echo "== $t: ${per}s"
  if ! ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1} \
       UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
       "$build/fuzz/$t" "$corpus" -max_total_time="$per" -max_len="$max_len" \
         -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=1024 -print_final_stats=1 \
         -artifact_prefix="$artifacts/$t-" 2>"$work/$t.log"; then
    tail -n 60 "$work/$t.log" >&2
    echo "fuzz.sh: $t FAILED (reproducer in $artifacts/)" >&2
    failed+=("$t")
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/$t.log" | sed "s/^/  $t /" || true
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: failing targets: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: all ${#targets[@]} targets ran ${per}s each without a crash"

#!/usr/bin/env bash
# Builds and runs the whole test suite: release build (g++) + ctest, then the
# sanitizer build (clang, ASan+UBSan) + ctest, then a short fuzz run of every
# decoder from that same build. Used by the README's test command and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# Every stage ends with its wall time, so CI's 25-minute budget is accounted.
# Beside the wall time, the CPU seconds of the stage's commands (user+sys of
# finished children, from `times`): on a loaded machine the wall time grows,
# the CPU time says what the stage costs.
# (`times` must run in this shell, not in a pipe's subshell.)
cpu_file=$(mktemp)
trap 'rm -f "$cpu_file" "$cpu_file.sum"' EXIT
children_cpu() {
  times >"$cpu_file"
  awk 'NR==2 { t = 0; for (i = 1; i <= 2; ++i) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%d", t }' "$cpu_file"
}
stage_name=""; stage_start=$SECONDS; stage_cpu=0
stage() {
  local cpu; children_cpu >"$cpu_file.sum"; cpu=$(cat "$cpu_file.sum")
  [ -n "$stage_name" ] && echo "-- $stage_name: $((SECONDS - stage_start)) s wall, $((cpu - stage_cpu)) s CPU"
  stage_name=$1; stage_start=$SECONDS; stage_cpu=$cpu
  [ -n "$1" ] && echo "== $1"
  return 0
}

stage "release build and tests"
# Each unit test is compiled once: every module's under the sanitizers
# below; here only those whose time bounds need a full-speed build (server:
# request limits; model: the tokenizer's growth), besides the C API, CLI and
# Python tests, which need the release binaries.
# All three builds are unity builds (CMakeLists.txt says how colliding files
# stay out of the batches): each header parsed once per batch of 8 files.
# Measured without ccache: test_cache's 10 batched test files under TSan
# 79.6 s CPU one by one, 40.6 s in two batches.
# Test code at -O1 (KVCODEC_TEST_CXX_FLAGS, CMakeLists.txt): what the time
# bounds measure is the library and server, built at -O3 as shipped.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVCODEC_TEST_MODULES="server;model" -DCMAKE_UNITY_BUILD=ON \
  -DKVCODEC_TEST_CXX_FLAGS=-O1 >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

stage "the same release build with its AVX2 paths off (KVCODEC_SIMD=off): the plain paths"
# The library picks its AVX2/FMA/F16C functions at run time (no
# -march=native); KVCODEC_SIMD=off runs the plain ones, as a CPU without
# AVX2 would. Here: the C API's byte checks against the C++ library; the
# kernels (entropy, kvtc) and the caches' golden files run on the plain
# paths in the sanitizer build below, where their tests are built. Tests
# comparing the two paths bit for bit (RansFast, Codec, SimdBytes) run in
# every pass.
KVCODEC_SIMD=off ctest --test-dir build --output-on-failure -j"$jobs" -L '^capi$' -E 'CapiWithCli'

stage "Python package: pip install ./python into a fresh venv (offline), pytest"
# Measured on the 2-core CI machine under load: 57 s wall, 24 s CPU (venv
# 13 s, pip install 2 s, 43 tests); the C API's ctest entries (label capi,
# in the run above) take 24-49 s wall at -j2, most of it `kvcodec calibrate`.
# Debian's python3 (numpy, torch, pytest from apt), whatever else is on PATH.
py=/usr/bin/python3
[ -x "$py" ] || py=python3
venv=build/venv
rm -rf "$venv"
"$py" -m venv --system-site-packages "$venv"
# The library just built is bundled; --no-index: nothing is fetched.
KVCODEC_LIBRARY="$PWD/build/libkvcodec.so" "$venv/bin/pip" install --no-index --quiet ./python
root=$PWD
(cd tests/python && KVCODEC_CLI="$root/build/kvcodec" KVCODEC_SHARED_DIR="$root/../shared" \
  "$root/$venv/bin/python" -m pytest -q -p no:cacheprovider .)

stage "sanitizer build (clang, ASan+UBSan; also the libFuzzer targets) and tests"
# One instrumented build serves both the test suite and the fuzz run (a
# second library build would cost CI ~8 minutes on 2 cores): the libraries
# are compiled with -fsanitize=fuzzer-no-link,address,undefined, the tests
# without the fuzzer's coverage instrumentation (cmake/KvcodecModule.cmake),
# only the fuzz executables link libFuzzer's main. Test code stays at -O1
# here: at -O0 test_entropy and test_kvtc compiled in 40 s instead of 78 s
# of CPU but ran 33 s longer, twice over with the SIMD-off pass below.
san=build-san
cmake -S . -B "$san" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DKVCODEC_FUZZ=ON -DKVCODEC_TESTS=ON -DKVCODEC_BENCH=OFF -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" >/dev/null
cmake --build "$san" -j"$jobs"
# Label slow: tests that drive the kvcodec CLI through whole-model runs
# (calibrate, bench, eval; CapiWithCli.*) ran in the release build above;
# under ASan they took 640 s of test time (~5 min wall at -j2) and check
# results, not input handling. The CLI's bad-input tests and every unit test run here.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$san" --output-on-failure -j"$jobs" -LE slow
# The plain paths of the dispatched kernels under the sanitizers too.
# Not Codec.RateTargetHoldsOnTheDecodedFitTokens (39 s here): a fit's
# result, the same on both paths since their bits are (Codec.AvxAndPlain*).
KVCODEC_SIMD=off ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$san" --output-on-failure -j"$jobs" -L '^(entropy|kvtc)$' -E 'RateTargetHolds'
KVCODEC_SIMD=off ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir "$san" --output-on-failure -j"$jobs" -L '^cache$' -R 'Golden|FuzzSeeds|SimdBytes|KvtcBitChoices'

if [ -f fuzz/CMakeLists.txt ]; then
  stage "fuzz run"
  KVCODEC_FUZZ_BUILD_DIR="$san" bash scripts/fuzz.sh "${KVCODEC_FUZZ_SECONDS:-60}"
fi

stage "ThreadSanitizer build (clang, -O1) of the server and cache tests"
# Only these two test binaries (and the libraries under them) to keep CI
# time small; OpenMP teams of one thread unless a test asks for more (what
# is checked: the server's HTTP, model and store threads, concurrent cache
# reads, the OpenMP teams named below).
tsan=build-tsan
# Test code at -O0: the few tests run here spend their time in the
# server's and caches' threads (-O1), not in test code.
cmake -S . -B "$tsan" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_COMPILER=clang++ \
  -DKVCODEC_TSAN=ON -DKVCODEC_TESTS=ON -DKVCODEC_BENCH=OFF -DCMAKE_UNITY_BUILD=ON \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -gline-tables-only" -DKVCODEC_TEST_CXX_FLAGS=-O0 >/dev/null
cmake --build "$tsan" -j"$jobs" --target test_server test_cache
export OMP_NUM_THREADS=1 TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
# The suites where threads or processes meet (HTTP and model threads, the
# store's writers, Redis, kills); the format suites (logprobs, dashboard,
# limits' time bounds) run in the two builds above.
# Debian's cpp-httplib is a compiled, uninstrumented library: TSan sees its
# allocations and the memcmp it calls but not its own synchronisation, and
# reported a race inside it between two of its pool threads when 64
# connections arrived at once (ServerConcurrency.ABurstOfConnections...,
# session 14); ignore_noninstrumented_modules drops reports from
# interceptors called inside such libraries, as for libomp below. Races in
# kvcodec's own (instrumented) code are still reported.
TSAN_OPTIONS="$TSAN_OPTIONS ignore_noninstrumented_modules=1" "$tsan"/src/server/test_server \
  --gtest_filter='ServerConcurrency.*:ServerFaults.*:ServerTest.*:ServerModelIdentity.*:PrefixStore.*:DiskStoreTest.*:DiskStoreKill.*:RedisServers.*:RedisStoreTest.*-*Dashboard*'
# Of test_cache, the tests where threads meet (TSan has nothing to check in
# a one-thread test): four std::threads fetching one calibrated cache; local
# kvtc fitting, encoding and loading with 3 and 4 OpenMP threads (num_threads
# overrides OMP_NUM_THREADS), one case with a decode error thrown inside the
# team; compress_dump's layers on 2 OpenMP threads with its progress
# callback. The contract suites (one thread each) run in the two builds above.
# libomp is not instrumented: libomp-dev's Archer (loaded by libomp when it
# finds TSan) gives TSan OpenMP's synchronisation, and
# ignore_noninstrumented_modules drops reports from inside libomp itself (a
# mutex it initialises on one thread and locks on another). A deliberate race
# in an OpenMP loop is still reported with these settings.
TSAN_OPTIONS="$TSAN_OPTIONS ignore_noninstrumented_modules=1" "$tsan"/src/cache/test_cache --gtest_filter='CalibratedCache.ConcurrentReadsOfOneCacheAgree:KvtcLocalLoad.OtherTokenLayoutSettingsAreAConfigError:KvtcLocalLoad.CorruptPayloadsAreRefusedAtLoad:DumpCodec.EveryMethodRoundTripsLikeItsCache'
unset OMP_NUM_THREADS TSAN_OPTIONS

# --- GPU kernels (issue 7; owner: gpu): compile-only check -------------------
# CI has no GPU, so the CUDA build is not run here; this compiles the .cu files
# to objects (sm_90, no link) so that kernel code cannot rot unnoticed.
# Measured on the 2-core CI machine under load: 1m17s wall for both files
# in parallel (docs/gpu.md). Skipped where nvcc is absent.
if command -v nvcc >/dev/null 2>&1; then
  stage "CUDA kernels: compile-only (nvcc, sm_90)"
  cu_out=$(mktemp -d)
  cu_pids=()
  for f in src/gpu/cuda/*.cu; do
    nvcc -std=c++17 -arch=sm_90 --fmad=false -Xcompiler=-Wall,-Wextra -Isrc -Iinclude \
      -c "$f" -o "$cu_out/$(basename "$f").o" &
    cu_pids+=($!)
  done
  for p in "${cu_pids[@]}"; do wait "$p"; done
  rm -rf "$cu_out"
fi
stage ""
echo "== all stages passed in $SECONDS s"

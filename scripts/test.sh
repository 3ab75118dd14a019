#!/usr/bin/env bash
# Builds and runs the whole test suite: release build + ctest, then the
# sanitizer (ASan+UBSan) build + ctest, then a short fuzz run of every
# decoder. Used by the README's test command and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

echo "== release build and tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"

echo "== sanitizer build (ASan+UBSan) and tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVCODEC_SANITIZE=ON -DKVCODEC_BENCH=OFF \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j"$jobs" -LE slow

if [ -f fuzz/CMakeLists.txt ]; then
  echo "== fuzz run"
  bash scripts/fuzz.sh "${KVCODEC_FUZZ_SECONDS:-60}"
fi

#!/usr/bin/env bash
# ctest capi_install_roundtrip: installs the C API into a temporary prefix
# (cmake --install), checks libkvcodec.so exports kvcodec_* only, then builds
# tests/capi/roundtrip.c against the INSTALLED header and library only,
# twice (cc + pkg-config; CMake find_package(kvcodec)), and
# tests/capi/roundtrip.rs with rustc when it is installed, and runs them:
# every method round-trips a cache, calibrated kvtc with a calibration made
# here by `kvcodec calibrate` (skipped without the shared model).
# Usage: install_roundtrip.sh BUILD_DIR SOURCE_DIR KVCODEC_CLI SHARED_DIR
set -euo pipefail
build=$1 src=$2 cli=$3 shared=$4
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" --component capi > "$work/install.log"
pc=$(find "$prefix" -name kvcodec.pc)
libdir=$(dirname "$(dirname "$pc")")
test -f "$prefix/include/kvcodec/kvcodec.h"
test -f "$libdir/cmake/kvcodec/kvcodecConfig.cmake"
# Only the C API's symbols are exported.
others=$(nm -D --defined-only "$libdir/libkvcodec.so" | awk '{print $3}' | grep -v '^kvcodec_' || true)
if [ -n "$others" ]; then echo "FAIL: libkvcodec.so exports more than kvcodec_*:"; echo "$others" | head; exit 1; fi
echo "exports: $(nm -D --defined-only "$libdir/libkvcodec.so" | grep -c ' kvcodec_') kvcodec_* symbols, nothing else"

cal=""
tokens=$shared/models/tinycode/eval_tokens.u16
dump=$shared/models/tinycode/kv_dump.safetensors
if [ -f "$tokens" ] && [ -f "$dump" ]; then
  "$cli" calibrate --tokens "$tokens" --windows 3-3 --tokens-per-window 128 --threads 1 \
    --set kvtc.target_ratio=8 --set kvtc.sensitivity=none -o "$work/cal.kvcal" > /dev/null 2>&1
  # Layer 1's first 300 tokens of the dump as [S, H, D] f32 (what roundtrip.c/.rs read).
  python3 - "$dump" "$work" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack_from("<Q", data)[0]
header = json.loads(data[8:8 + n])
for what in ("key", "value"):
    info = header["layers.1." + what]
    _, H, T, D = info["shape"]
    fmt = {"F16": "e", "F32": "f"}[info["dtype"]]
    size = struct.calcsize(fmt)
    a = info["data_offsets"][0] + 8 + n
    x = struct.unpack_from("<%d%s" % (H * T * D, fmt), data, a)
    S = 300
    out = [x[(h * T + s) * D + d] for s in range(S) for h in range(H) for d in range(D)]
    open("%s/%s.f32" % (sys.argv[2], what), "wb").write(struct.pack("<%df" % len(out), *out))
PY
  cal="$work/cal.kvcal $work/key.f32 $work/value.f32"
else
  echo "calibrated kvtc: SKIP (no model tokens or KV dump in $shared)"
fi

echo "== C (cc -std=c99 -pedantic, pkg-config)"
export PKG_CONFIG_PATH=$libdir/pkgconfig
# shellcheck disable=SC2046
cc -std=c99 -Wall -Wextra -pedantic -Werror "$src/tests/capi/roundtrip.c" -o "$work/roundtrip" \
  $(pkg-config --cflags --libs kvcodec) -lm -Wl,-rpath,"$libdir"
"$work/roundtrip" $cal

echo "== C (CMake find_package(kvcodec))"
cmake -S "$src/tests/capi/find_package" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_RPATH="$libdir" > "$work/consumer.log"
cmake --build "$work/consumer" > "$work/consumer_build.log"
"$work/consumer/roundtrip_cmake" $cal > /dev/null

if command -v rustc > /dev/null; then
  echo "== Rust ($(rustc --version))"
  rustc --edition 2021 "$src/tests/capi/roundtrip.rs" -o "$work/roundtrip_rs" \
    -L "$libdir" -C link-arg=-Wl,-rpath,"$libdir" 2> "$work/rustc.log" || { cat "$work/rustc.log"; exit 1; }
  "$work/roundtrip_rs" $cal
else
  echo "Rust: SKIP (no rustc; bash scripts/install_deps.sh installs it)"
fi
echo PASS

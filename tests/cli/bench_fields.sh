#!/usr/bin/env bash
# kvcodec bench's speed fields on the shipped KV dump (ctest: cli_bench_fields):
# with zstd among the methods every other method gets encode_vs_zstd /
# decode_vs_zstd (medians of same-repeat ratios), zstd itself does not, and
# without zstd nobody does; the best-of MB/s fields are always there.
# Usage: bench_fields.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
dump=$2/models/tinycode/kv_dump.safetensors
if [ ! -f "$dump" ]; then echo "SKIP: no KV dump at $dump"; exit 0; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-bench.XXXXXX")
trap 'rm -rf "$work"' EXIT

"$kvcodec" bench --kv "$dump" --methods zstd,int8 --repeats 3 --no-bound --json >"$work/with.json"
"$kvcodec" bench --kv "$dump" --methods int8 --repeats 2 --no-bound --json >"$work/without.json"
"$kvcodec" bench --kv "$dump" --methods zstd --repeats 2 --json >"$work/zstd.json"
python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
with_z = json.load(open(f"{w}/with.json"))
assert [r["method"] for r in with_z] == ["zstd", "int8"], [r["method"] for r in with_z]
for r in with_z + json.load(open(f"{w}/without.json")) + json.load(open(f"{w}/zstd.json")):
    for f in ("encode_mb_per_s", "decode_mb_per_s"):
        assert r[f] > 0, (r["method"], f, r.get(f))
for r in with_z:
    if r["method"] == "zstd":
        assert "encode_vs_zstd" not in r and "decode_vs_zstd" not in r, r
    else:
        assert r["fit_encode_mb_per_s"] > 0, r
        for f in ("encode_vs_zstd", "decode_vs_zstd"):
            # a ratio of two wall-clock speeds of the same repeat: positive and finite
            assert 0 < r[f] < 1e4, (r["method"], f, r[f])
# Memory as held beside the stored bytes: int8 holds its rows and a few
# hundred bytes per layer, shares nothing; resident_ratio is f16 / resident.
for r in with_z:
    if r["method"] == "int8":
        assert r["compressed_bytes"] <= r["resident_bytes"] <= r["compressed_bytes"] + 8192, r
        assert r["shared_bytes"] == 0, r
        f16 = r["compression_ratio"] * r["compressed_bytes"]
        assert abs(r["resident_ratio"] * r["resident_bytes"] - f16) < 1e-6 * f16, r
for r in json.load(open(f"{w}/without.json")):
    assert "encode_vs_zstd" not in r and "decode_vs_zstd" not in r, r
PY
# The text table names the ratio columns.
"$kvcodec" bench --kv "$dump" --methods zstd --repeats 1 2>/dev/null | grep -q "enc/zstd"
echo "bench fields OK"

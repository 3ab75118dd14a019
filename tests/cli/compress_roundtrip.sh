#!/usr/bin/env bash
# kvcodec compress / inspect / decompress end to end on the shipped KV dump
# (ctest: cli_compress_roundtrip). Usage: compress_roundtrip.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
dump=$2/models/tinycode/kv_dump.safetensors
if [ ! -f "$dump" ]; then echo "SKIP: no KV dump at $dump"; exit 0; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# int8: the file ratio is what the caches report, less the framing.
"$kvcodec" compress --kv "$dump" -o "$work/d.kvc" --method int8 --threads 2 --json >"$work/c.json"
"$kvcodec" inspect "$work/d.kvc" --json >"$work/i.json"
python3 - "$work" <<'PY'
import json, os, sys
w = sys.argv[1]
c = json.load(open(f"{w}/c.json")); i = json.load(open(f"{w}/i.json"))
size = os.path.getsize(f"{w}/d.kvc")
assert c["file_bytes"] == size == i["total_bytes"], (c["file_bytes"], size, i["total_bytes"])
assert i["kind"] == "dump" and i["meta"]["method"] == "int8", i["meta"]
assert len(i["layers"]) == c["n_layers"] == int(i["meta"]["n_layers"]) >= 1
assert 1.5 < c["file_ratio"] < c["caches"]["compression_ratio"] <= 2.0, c
assert abs(i["file_ratio"] - c["file_ratio"]) < 1e-9
# Memory as held: int8 holds its stored rows plus a few hundred bytes per
# layer, shares nothing, and the held ratio is f16 / resident; inspect (which
# loads the caches) reports the same.
for cc in (c["caches"], i["caches"]):
    stored = cc["compressed_key_bytes"] + cc["compressed_value_bytes"]
    assert stored <= cc["resident_bytes"] <= stored + 1024 * c["n_layers"], cc
    assert cc["shared_bytes"] == 0, cc
    f16 = cc["fp16_key_bytes"] + cc["fp16_value_bytes"]
    assert abs(cc["resident_ratio"] - f16 / cc["resident_bytes"]) < 1e-9, cc
PY

# decompress, then fp16 of the reconstruction: lossless from there on.
"$kvcodec" decompress "$work/d.kvc" -o "$work/r.safetensors" --dtype f16
"$kvcodec" compress --kv "$work/r.safetensors" -o "$work/r.kvc" --method fp16
"$kvcodec" decompress "$work/r.kvc" -o "$work/r2.safetensors"
python3 - "$work" <<'PY'
import json, struct, sys
w = sys.argv[1]
def tensors(path):
    b = open(path, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); base = 8 + n
    return {k: b[base + v["data_offsets"][0]: base + v["data_offsets"][1]] for k, v in h.items() if k != "__metadata__"}
a, b = tensors(f"{w}/r.safetensors"), tensors(f"{w}/r2.safetensors")
assert a.keys() == b.keys() and len(a) >= 2, (a.keys(), b.keys())
for k in a: assert a[k] == b[k], k
PY

# Bad input: clear errors, non-zero exit, never a crash.
head -c 1000 "$work/d.kvc" >"$work/t.kvc"
if "$kvcodec" inspect "$work/t.kvc" 2>"$work/err"; then fail "inspect accepted a truncated file"; fi
grep -q "kvcodec: error" "$work/err" || fail "no clear error for a truncated file: $(cat "$work/err")"
if "$kvcodec" decompress "$dump" -o "$work/x.safetensors" 2>"$work/err"; then fail "decompress accepted a safetensors file"; fi
grep -q "kvcodec: error" "$work/err" || fail "no clear error for a non-container: $(cat "$work/err")"
if "$kvcodec" compress --kv "$dump" -o "$work/y.kvc" --method int4 --set int4.group_size=7 2>"$work/err"; then
  fail "compress accepted group_size=7"; fi
grep -q "group_size" "$work/err" || fail "error does not name the field: $(cat "$work/err")"
[ ! -e "$work/y.kvc" ] || fail "a failed compress left an output file"
echo "PASS"

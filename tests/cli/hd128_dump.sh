#!/usr/bin/env bash
# scripts/make_hd128_dump.py (ctest: cli_hd128_dump): the head_dim-128 dump of
# the speed bar holds, for every layer, the two KV heads of the shared dump
# side by side (key and value [1, 1, S, 128]; queries [1, 3, Q, 128], head j
# = heads j and j + 3), kvcodec bench reads it, and a dump whose layers do
# not have two KV heads is refused with a message naming the tensor.
# Usage: hd128_dump.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
dump=$2/models/tinycode/kv_dump.safetensors
script=$(dirname "$0")/../../scripts/make_hd128_dump.py
if [ ! -f "$dump" ]; then echo "SKIP: no KV dump at $dump"; exit 0; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-hd128.XXXXXX")
trap 'rm -rf "$work"' EXIT

python3 "$script" "$dump" "$work/hd128.safetensors"
python3 - "$dump" "$work/hd128.safetensors" "$work/three_heads.safetensors" <<'PY'
import json, struct, sys
def read(p):
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read()
hi, di = read(sys.argv[1])
ho, do = read(sys.argv[2])
assert set(hi) == set(ho), (sorted(hi), sorted(ho))
for name, t in hi.items():
    if name == "__metadata__" or not name.startswith("layers."):
        continue
    b, h, s, d = t["shape"]
    assert ho[name]["shape"] == [b, h // 2, s, 2 * d], (name, ho[name]["shape"])
    bi, bo = t["data_offsets"][0], ho[name]["data_offsets"][0]
    row = 2 * d  # f16 bytes of one head's row
    for head in range(h):  # every row of every head lands where the pairing says
        j, g = head % (h // 2), head // (h // 2)
        for tok in range(s):
            src = bi + (head * s + tok) * row
            dst = bo + (j * s + tok) * 2 * row + g * row
            assert di[src:src + row] == do[dst:dst + row], (name, head, tok)
assert hi["input_ids"]["shape"] == ho["input_ids"]["shape"]
# A dump with three KV heads in layer 0: the script must refuse it.
text = json.dumps({"layers.0.key": {"dtype": "F16", "shape": [1, 3, 2, 4], "data_offsets": [0, 48]},
                   "layers.0.value": {"dtype": "F16", "shape": [1, 3, 2, 4], "data_offsets": [48, 96]}}).encode()
text += b" " * ((-len(text)) % 8)
with open(sys.argv[3], "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + bytes(96))
PY
"$kvcodec" bench --kv "$work/hd128.safetensors" --methods fp16 --repeats 1 --no-bound --json >"$work/bench.json"
python3 - "$work/bench.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))[0]
assert r["compressed_bytes"] == 6 * 2 * 2048 * 128 * 2, r["compressed_bytes"]  # 6 layers, K and V, f16
PY
if python3 "$script" "$work/three_heads.safetensors" "$work/out.safetensors" 2>"$work/err"; then
  echo "FAIL: a dump with 3 KV heads was accepted"; exit 1
fi
grep -q "layers.0.key has 3 KV heads, expected 2" "$work/err" || { echo "FAIL: message: $(cat "$work/err")"; exit 1; }
echo "hd128_dump: ok"

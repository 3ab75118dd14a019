#!/usr/bin/env bash
# kvcodec eval with method variants (<method>:<label> and its own --set), on a
# tiny window of the shipped model (ctest: cli_eval_variants).
# Usage: eval_variants.sh KVCODEC SHARED_DIR
set -euo pipefail
kvcodec=$1
tokens=$2/models/tinycode/eval_tokens.u16
if [ ! -f "$tokens" ]; then echo "SKIP: no eval tokens at $tokens"; exit 0; fi
out=$("$kvcodec" eval --tokens "$tokens" --windows 1 --context 96 --score 8 --threads 1 --json \
        --methods int4,int4:g16,int4:g64 --set int4:g16.group_size=16 --set int4:g64.group_size=64)
python3 -c '
import json, sys
r = {m["method"]: m for m in json.loads(sys.argv[1])}
assert set(r) == {"int4", "int4:g16", "int4:g64"}, r.keys()
# Smaller groups store more scales: the ratios must order by group size.
assert r["int4:g16"]["compression_ratio"] < r["int4"]["compression_ratio"] < r["int4:g64"]["compression_ratio"], r
assert all(m["scored"] == 8 for m in r.values())
# Memory as held beside the stored bytes (int4 shares nothing).
for m in r.values():
    assert m["resident_bytes"] >= m["compressed_bytes"] and m["shared_bytes"] == 0, m
    assert abs(m["resident_ratio"] * m["resident_bytes"] - m["fp16_bytes"]) < 1e-6 * m["fp16_bytes"], m
' "$out"
# A variant without a label is refused, naming the option.
if "$kvcodec" eval --tokens "$tokens" --windows 1 --context 16 --score 2 --methods "int4:" 2>/tmp/kvcodec-eval-err.$$; then
  echo "FAIL: accepted int4:" >&2; exit 1; fi
grep -q -- "--methods" /tmp/kvcodec-eval-err.$$ || { echo "FAIL: $(cat /tmp/kvcodec-eval-err.$$)" >&2; exit 1; }
rm -f /tmp/kvcodec-eval-err.$$
echo PASS

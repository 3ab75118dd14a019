#!/usr/bin/env bash
# kvcodec eval --text FILE|DIR and its errors; needs nothing outside the
# repository (ctest: cli_eval_text).
# Usage: eval_text.sh KVCODEC
set -euo pipefail
kvcodec=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# Text written here (no file of another project): ~90 tokens a function.
for i in $(seq 1 40); do
  printf 'def scale_%d(values, factor=%d):\n    """Multiply every value by %d."""\n    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n\n\n' "$i" "$i" "$i"
done > "$dir/a.py"
out=$("$kvcodec" eval --text "$dir/a.py" --windows 2 --context 64 --score 8 --threads 1 --json --methods fp16,int4)
python3 -c '
import json, sys
r = {m["method"]: m for m in json.loads(sys.argv[1])}
assert set(r) == {"fp16", "int4"}, r.keys()
assert all(m["scored"] == 16 for m in r.values()), r
assert r["fp16"]["ppl_change_pct"] == 0 and r["fp16"]["kl"] == 0, r["fp16"]
assert 1.5 < r["int4"]["compression_ratio"] < 4.5, r["int4"]
# Code this regular is easy to predict: a perplexity far below the vocabulary size.
assert r["fp16"]["ppl"] < 20, r["fp16"]
' "$out"
# A folder is read in sorted order: the same text split in two files scores the same.
mkdir "$dir/split"
head -n 160 "$dir/a.py" > "$dir/split/1.py"
tail -n +161 "$dir/a.py" > "$dir/split/2.py"
"$kvcodec" eval --text "$dir/split" --windows 1 --context 64 --score 8 --threads 1 --methods fp16 > "$dir/table"
grep -q "2 files" "$dir/table" || { echo "FAIL: $(cat "$dir/table")" >&2; exit 1; }
# Too short: refused, naming the tokens it has and needs.
printf 'x = 1\n' > "$dir/short.py"
if "$kvcodec" eval --text "$dir/short.py" --windows 1 --context 64 --score 8 --threads 1 2> "$dir/err"; then
  echo "FAIL: a 4-token text accepted" >&2; exit 1; fi
grep -q "tokens; 1 window(s) of 72 from window 0 need 72" "$dir/err" || { echo "FAIL: $(cat "$dir/err")" >&2; exit 1; }
if "$kvcodec" eval --text "$dir/missing.txt" --windows 1 2> "$dir/err"; then echo "FAIL: missing file accepted" >&2; exit 1; fi
grep -q "missing.txt" "$dir/err" || { echo "FAIL: $(cat "$dir/err")" >&2; exit 1; }
if "$kvcodec" eval --text "$dir/a.py" --tokens "$dir/a.py" 2> "$dir/err"; then echo "FAIL: --text with --tokens" >&2; exit 1; fi
echo PASS

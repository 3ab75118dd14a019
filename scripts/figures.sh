#!/usr/bin/env bash
# Regenerates the figures of the README's main job on the default corpus
# (docs/eval.md), into docs/data/:
#   main_job.tsv           the README's eval table (window 0, context 1024, score 128)
#   default_corpus.tsv     every method over windows FIRST..LAST of the corpus, with the
#                          per-window spread of the perplexity change (standard error)
# Usage: scripts/figures.sh [BUILD_DIR (build)] [LAST_WINDOW (17)]
# Needs only the repository and the install step (no ../shared). Other docs'
# figures (KV-dump sweep, calibrated tables) come from the commands in their docs.
# The stored-prefix table of docs/calibrated.md (issue 21): scripts/stored_prefix_figures.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
last=${2:-17}
methods=fp16,int8,int4,kivi2,palu,kvtc
out=docs/data
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$(date +%s)
"$build/kvcodec" eval --methods "$methods" --windows 1 --context 1024 --score 128 --threads 1 --json > "$tmp/main.json"
for w in $(seq 0 "$last"); do
  "$build/kvcodec" eval --methods "$methods" --first-window "$w" --windows 1 --context 1024 --score 128 \
    --threads 1 --json > "$tmp/w$w.json"
done
python3 - "$tmp" "$last" "$out" <<'PY'
import json, math, sys
tmp, last, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cols = "method\tratio_stored\tppl\tppl_change_pct\tkl\ttop1\ttokens_per_s"
with open(f"{out}/main_job.tsv", "w") as f:
    print(cols, file=f)
    for m in json.load(open(f"{tmp}/main.json")):
        print(f"{m['method']}\t{m['compression_ratio']:.3f}\t{m['ppl']:.4f}\t{m['ppl_change_pct']:+.2f}\t"
              f"{m['kl']:.4e}\t{m['top1_agreement']:.4f}\t{m['tokens_per_s']:.1f}", file=f)
runs = [json.load(open(f"{tmp}/w{w}.json")) for w in range(last + 1)]
with open(f"{out}/default_corpus.tsv", "w") as f:
    print(f"# windows 0-{last} of the default corpus, context 1024, score 128; ppl change: mean of the "
          "per-window changes and its standard error; ratio: sum of f16 bytes / sum of stored bytes", file=f)
    print("method\tratio_stored\tppl_change_pct_mean\tppl_change_pct_se\tkl_mean\ttop1_mean", file=f)
    for i, name in enumerate(m["method"] for m in runs[0]):
        rows = [r[i] for r in runs]
        ch = [r["ppl_change_pct"] for r in rows]
        n = len(ch)
        mean = sum(ch) / n
        se = math.sqrt(sum((c - mean) ** 2 for c in ch) / (n - 1) / n) if n > 1 else float("nan")
        ratio = sum(r["fp16_bytes"] for r in rows) / sum(r["compressed_bytes"] for r in rows)
        print(f"{name}\t{ratio:.3f}\t{mean:+.2f}\t{se:.2f}\t{sum(r['kl'] for r in rows) / n:.4e}\t"
              f"{sum(r['top1_agreement'] for r in rows) / n:.4f}", file=f)
PY
echo "figures.sh: wrote $out/main_job.tsv and $out/default_corpus.tsv in $(( $(date +%s) - start )) s"

#!/bin/sh
# Draws docs/img/rate_quality.png (ratio vs perplexity increase and KL) from
# docs/data/calibrated_*.tsv and, when it exists, the lead's
# docs/data/rate_quality_baselines.tsv. Every file has the tab-separated
# columns  method settings ratio ppl ppl_increase_pct kl top1  (a header line
# starting with "method" is skipped); one curve per method, points sorted by
# ratio. A docs tool: needs gnuplot (apt-get install -y gnuplot-nox).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
files=$(ls "$root"/docs/data/calibrated_*.tsv "$root"/docs/data/rate_quality_baselines.tsv 2>/dev/null || true)
[ -n "$files" ] || { echo "no data in $root/docs/data" >&2; exit 1; }
# One file per method: ratio, ppl increase %, KL (methods named without spaces).
cat $files | awk -F'\t' -v dir="$tmp" '$1 != "method" && NF >= 7 && $1 !~ /^#/ {
  gsub(/[^A-Za-z0-9_.+-]/, "_", $1); print $3 "\t" $5 "\t" $6 >> (dir "/" $1 ".dat") }'
series=""
for f in "$tmp"/*.dat; do
  sort -g "$f" > "$f.sorted"
  series="$series $f.sorted"
done
mkdir -p "$root/docs/img"
gnuplot -e "series='$series'; outfile='$root/docs/img/rate_quality.png'" "$root/scripts/plot_rate_quality.gp"
echo "wrote $root/docs/img/rate_quality.png"

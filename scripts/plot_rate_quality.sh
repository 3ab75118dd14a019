#!/bin/sh
# Draws docs/rate_quality.png from docs/rate_quality.tsv (see docs/calibrated.md).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
gnuplot -e "datafile='$root/docs/rate_quality.tsv'; outfile='$root/docs/rate_quality.png'" "$root/scripts/plot_rate_quality.gp"
echo "wrote $root/docs/rate_quality.png"

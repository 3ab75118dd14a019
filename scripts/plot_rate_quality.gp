# Rate-quality curves: compression ratio against perplexity increase and KL.
# Driven by scripts/plot_rate_quality.sh, which sets `series` (space-separated
# data files "<method>.dat.sorted" with columns ratio, ppl increase %, KL)
# and `outfile`.
set terminal pngcairo size 1200,500 font ",10" noenhanced
set output outfile
name(f) = system("basename " . f . " .dat.sorted")
set multiplot layout 1,2 title "tinycode: quality vs compression, all stored bytes counted (protocol of each data file: docs/calibrated.md)"
set logscale x 2
set grid
set key top left
set xlabel "compression ratio (f16 bytes / all stored bytes)"
set ylabel "perplexity increase vs fp16 cache (%), clipped at 12"
set yrange [-3:12]
plot for [f in series] f using 1:2 with linespoints pt 7 title name(f)
set autoscale y
set ylabel "KL(fp16 || method), nats/token"
set logscale y
set key bottom right
plot for [f in series] f using 1:3 with linespoints pt 7 title name(f)
unset multiplot

# Rate-quality curves: compression ratio against perplexity increase and KL.
# Driven by scripts/plot_rate_quality.sh, which sets `series` (space-separated
# data files "<method>.dat.sorted" with columns ratio, ppl increase %, KL)
# and `outfile`.
set terminal pngcairo size 1200,500 font ",10" noenhanced
set output outfile
name(f) = system("basename " . f . " .dat.sorted")
# More series than gnuplot's 8 default colours: 14 distinct colours, and
# the point shape changes every 7 series, so no two curves look alike.
array colours[14] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", \
                     "#7f7f7f", "#bcbd22", "#17becf", "#000000", "#aec7e8", "#98df8a", "#ff9896"]
n = words(series)
set multiplot layout 1,2 title "tinycode: quality vs compression, all stored bytes counted (protocol of each data file: docs/history/calibrated-sessions.md)"
set logscale x 2
set grid
set key top left
set xlabel "compression ratio (f16 bytes / all stored bytes)"
set ylabel "perplexity increase vs fp16 cache (%), clipped at 12"
set yrange [-3:12]
plot for [i=1:n] word(series, i) using 1:2 with linespoints lc rgb colours[(i - 1) % 14 + 1] \
     pt (i <= 7 ? 7 : 5) title name(word(series, i))
set autoscale y
set ylabel "KL(fp16 || method), nats/token"
set logscale y
set key bottom right
plot for [i=1:n] word(series, i) using 1:3 with linespoints lc rgb colours[(i - 1) % 14 + 1] \
     pt (i <= 7 ? 7 : 5) title name(word(series, i))
unset multiplot

# Rate-quality curve: compression ratio against perplexity increase and KL.
# Input: docs/rate_quality.tsv with columns
#   method  compression_ratio  ppl_increase_percent  kl
# (one block per method, blocks separated by two blank lines, a '# name'
# comment line first). Driven by scripts/plot_rate_quality.sh.
set terminal pngcairo size 1200,500 font ",10"
set output outfile
set multiplot layout 1,2 title "tinycode, windows 0-7 (context 1024, score 512): quality vs compression"
set logscale x 2
set grid
set key top left
set xlabel "compression ratio (f16 bytes / all stored bytes)"
set ylabel "perplexity increase vs fp16 cache (%)"
plot for [i=0:*] datafile index i using 2:3 with linespoints pt 7 title columnheader(1)
set ylabel "KL(fp16 || method), nats/token"
set logscale y
plot for [i=0:*] datafile index i using 2:4 with linespoints pt 7 title columnheader(1)
unset multiplot

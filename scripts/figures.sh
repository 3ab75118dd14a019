#!/usr/bin/env bash
# Regenerates, at the checked-out commit, the figures README.md and docs/eval.md
# quote from docs/data/. Each part runs on its own (a full run is long on a
# loaded machine); no part given: all of them.
#   main    docs/data/main_job.tsv: the README's eval, every method on
#           windows 0-8 of the default corpus (context 1024, score 128), ppl
#           change with its spread across windows (se). 0-8 are the reported
#           windows: 9-17 chose the shipped calibration's target
#           (models/tinycode/CALIBRATION.md) and palu's defaults
#           (docs/eval.md). Needs only the repository and the install step
#           (no ../shared).
#   local   docs/data/local_kvtc_{choose,report}.tsv: local kvtc's default
#           preset chosen on windows 9-17 (rate allocator targets, the earlier
#           dp defaults), reported on 0-8 (docs/kvtc.md "Defaults"). No ../shared.
#   speed   docs/data/speed.tsv: kvtc (local, default settings) against zstd -3,
#           single thread, same run, at head_dim 64 (the shared KV dump) and
#           128 (made from it by scripts/make_hd128_dump.py); and kvtc-calibrated
#           (the shipped model's default: its calibration and kvtc.settings) at
#           64. Needs ../shared.
#   dump    docs/data/methods_dump.tsv: every method at its defaults on the
#           shared KV dump (ratio, errors, bits, attention error, speed
#           against zstd -3 in the same run), and the two kvtc settings
#           docs/caches.md compares (the earlier dp defaults; the rate
#           allocator at int4's errors). Needs ../shared.
# Usage: scripts/figures.sh [--build DIR (build)] [main] [local] [speed] [dump]
# Other docs' figures (the calibrated tables, the GPU) come from the
# commands written in those docs.
# The stored-prefix table of docs/history/calibrated-sessions.md (issue 21): scripts/stored_prefix_figures.sh.
# The streaming table of docs/history/calibrated-sessions.md (issue 21, session 16): scripts/issue21_windowed.sh
# (about 5 min on 16 CPU cores; the GPU machine's were used).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
parts=()
while (($#)); do
  case "$1" in
    --build) build=$2; shift 2 ;;
    main|local|speed|dump) parts+=("$1"); shift ;;
    *) echo "figures.sh: unknown argument '$1' (parts: main local speed dump; --build DIR)" >&2; exit 2 ;;
  esac
done
((${#parts[@]})) || parts=(main local speed dump)
methods=fp16,int8,int4,kivi2,palu,kvtc
out=docs/data
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
eval_flags=(--methods "$methods" --context 1024 --score 128 --threads 1 --json)

# eval JSON -> TSV; the ppl change and its se are eval's own (pooled ppl
# against the baseline's; se of the per-window changes).
eval_tsv() {  # JSON OUT WINDOWS HEADER_COMMENT
  python3 - "$@" <<'PY'
import json, sys
src, dst, windows, comment = sys.argv[1:5]
with open(dst, "w") as f:
    print(f"# {comment}", file=f)
    print("method\tratio_stored\tratio_held\tppl\tppl_change_pct\tppl_change_se_pct\tkl\ttop1\ttokens_per_s", file=f)
    for m in json.load(open(src)):
        se = f"{m['ppl_change_se_pct']:.2f}" if int(windows) > 1 else "-"  # no spread from one window
        print(f"{m['method']}\t{m['compression_ratio']:.3f}\t{m['resident_ratio']:.3f}\t{m['ppl']:.4f}\t"
              f"{m['ppl_change_pct']:+.2f}\t{se}\t{m['kl']:.4e}\t"
              f"{m['top1_agreement']:.4f}\t{m['tokens_per_s']:.1f}", file=f)
PY
}

part_main() {
  "$build/kvcodec" eval "${eval_flags[@]}" --first-window 0 --windows 9 > "$tmp/main.json"
  eval_tsv "$tmp/main.json" "$out/main_job.tsv" 9 \
    "the README's eval: windows 0-8 of the default corpus, context 1024, score 128, --threads 1; se: standard error of the per-window ppl change"
}

# Local kvtc's default preset (issue 17 item 3): distortion targets of the
# rate allocator (int8 basis) and the earlier defaults (dp, 4*D bits) on the
# choosing windows 9-17, then the preset (no rate field) and dp on the
# reported windows 0-8. The two evals run side by side (one core each).
part_local() {
  local targets=(0.005 0.0075 0.01 0.015 0.02) choose=(--methods fp16,kvtc:dp256) t
  choose+=(--set kvtc:dp256.mode=local --set kvtc:dp256.bit_budget=256)
  for t in "${targets[@]}"; do
    local label=t${t#0.}  # labels cannot hold '.': t005 = 0.005
    choose[1]+=",kvtc:$label"
    choose+=(--set "kvtc:$label.mode=local" --set "kvtc:$label.allocator=rate" --set "kvtc:$label.target_rel_mse=$t"
             --set "kvtc:$label.basis_bits=8")
  done
  local flags=(--context 1024 --score 128 --threads 1 --json)
  "$build/kvcodec" eval "${flags[@]}" --first-window 9 --windows 9 "${choose[@]}" > "$tmp/choose.json" &
  "$build/kvcodec" eval "${flags[@]}" --first-window 0 --windows 9 --methods fp16,kvtc,kvtc:dp256 \
    --set kvtc.mode=local --set kvtc:dp256.mode=local --set kvtc:dp256.bit_budget=256 > "$tmp/report.json"
  wait $!
  eval_tsv "$tmp/choose.json" "$out/local_kvtc_choose.tsv" 9 \
    "local kvtc, windows 9-17 of the default corpus (choosing), context 1024, score 128, --threads 1; kvtc:tX = allocator=rate target_rel_mse=0.X basis_bits=8, kvtc:dp256 = bit_budget=256 (dp)"
  eval_tsv "$tmp/report.json" "$out/local_kvtc_report.tsv" 9 \
    "local kvtc, windows 0-8 of the default corpus (reported), context 1024, score 128, --threads 1; kvtc = mode=local at its defaults (the preset), kvtc:dp256 = bit_budget=256 (dp)"
}

part_speed() {
  local dump=../shared/models/tinycode/kv_dump.safetensors
  [[ -f $dump ]] || { echo "figures.sh speed: needs $dump" >&2; exit 2; }
  python3 scripts/make_hd128_dump.py "$dump" "$tmp/kv_dump_hd128.safetensors"
  for d in 64 128; do
    local kv=$dump
    [[ $d == 128 ]] && kv=$tmp/kv_dump_hd128.safetensors
    "$build/kvcodec" bench --kv "$kv" --methods kvtc,zstd --threads 1 --no-bound --json > "$tmp/speed$d.json"
  done
  # The shipped model's default kvtc (its calibration and kvtc.settings), head_dim 64 only.
  "$build/kvcodec" bench --kv "$dump" --methods kvtc,zstd --threads 1 --no-bound --json \
    --set kvtc.calibration=models/tinycode/kvtc.kvcal --set kvtc.sinks=4 --set kvtc.window=8 --set kvtc.refine=128 \
    > "$tmp/speed64cal.json"
  python3 - "$tmp" "$out/speed.tsv" <<'PY'
import json, sys
tmp, dst = sys.argv[1:3]
with open(dst, "w") as f:
    print("# kvcodec bench --methods kvtc,zstd --threads 1 --no-bound (11 interleaved repeats; MB/s of the "
          "dump as f16, best repeat; *_vs_zstd: median same-repeat ratio); head_dim 128: scripts/make_hd128_dump.py", file=f)
    print("head_dim\tmethod\tratio\tencode_mb_per_s\tdecode_mb_per_s\tencode_vs_zstd\tdecode_vs_zstd", file=f)
    for d, run, label in ((64, "64", ""), (128, "128", ""), (64, "64cal", "-calibrated")):
        for m in json.load(open(f"{tmp}/speed{run}.json")):
            vs = lambda k: f"{m[k]:.3f}" if k in m else "-"
            print(f"{d}\t{m['method']}{label if m['method'] == 'kvtc' else ''}\t{m['compression_ratio']:.3f}\t{m['encode_mb_per_s']:.1f}\t"
                  f"{m['decode_mb_per_s']:.1f}\t{vs('encode_vs_zstd')}\t{vs('decode_vs_zstd')}", file=f)
PY
}

# docs/caches.md's table: the whole dump as one prefill per layer, single
# thread; MB/s are not kept (this machine's noise), the same-run ratios are.
part_dump() {
  local dump=../shared/models/tinycode/kv_dump.safetensors
  [[ -f $dump ]] || { echo "figures.sh dump: needs $dump" >&2; exit 2; }
  local bench=("$build/kvcodec" bench --kv "$dump" --threads 1 --no-bound --json)
  "${bench[@]}" --methods "$methods,zstd" > "$tmp/dump_defaults.json"
  "${bench[@]}" --methods kvtc,zstd --set kvtc.bit_budget=256 > "$tmp/dump_dp256.json"
  "${bench[@]}" --methods kvtc,zstd --set kvtc.allocator=rate --set kvtc.basis_bits=8 --set kvtc.key_target_rel_mse=0.014 --set kvtc.value_target_rel_mse=0.0075 \
    > "$tmp/dump_int4err.json"
  python3 - "$tmp" "$out/methods_dump.tsv" <<'PY'
import json, sys
tmp, dst = sys.argv[1:3]
runs = (("defaults", "defaults"), ("dp256", "bit_budget=256 (dp: the local defaults before 5a44a2f)"),
        ("int4err", "allocator=rate basis_bits=8 key_target_rel_mse=0.014 value_target_rel_mse=0.0075 (at int4's errors)"))
with open(dst, "w") as f:
    print("# kvcodec bench --kv ../shared/models/tinycode/kv_dump.safetensors --threads 1 --no-bound (local kvtc: "
          "the bench has no model); *_vs_zstd: median same-repeat ratio against zstd -3", file=f)
    print("method\tsettings\tratio\trel_mse_key\trel_mse_value\tbits_per_element\tattn_rel_err\t"
          "encode_vs_zstd\tdecode_vs_zstd", file=f)
    for run, settings in runs:
        for m in json.load(open(f"{tmp}/dump_{run}.json")):
            if m["method"] == "zstd" or (run != "defaults" and m["method"] != "kvtc"):
                continue
            print(f"{m['method']}\t{settings}\t{m['compression_ratio']:.3f}\t{m['rel_mse_key']:.6f}\t"
                  f"{m['rel_mse_value']:.6f}\t{m['bits_per_element']:.3f}\t{m['attn_rel_err']:.4f}\t"
                  f"{m['encode_vs_zstd']:.3f}\t{m['decode_vs_zstd']:.3f}", file=f)
PY
}

for p in "${parts[@]}"; do
  start=$(date +%s)
  "part_$p"
  echo "figures.sh: $p done in $(( $(date +%s) - start )) s"
done

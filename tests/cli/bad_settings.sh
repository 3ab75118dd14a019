#!/usr/bin/env bash
# Every bad method setting ends in a configuration error naming the field,
# exit code 2, never an abort (ctest: cli_bad_settings).
# Usage: bad_settings.sh KVCODEC SHARED_DIR
set -uo pipefail
kvcodec=$1
model=$2/models/tinycode
dump=$model/kv_dump.safetensors
if [ ! -f "$dump" ] || [ ! -f "$model/config.json" ]; then echo "SKIP: no tinycode model at $model"; exit 0; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvcodec-cli.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0

# expect_config_error FIELD COMMAND...: exit 2, "configuration error" and FIELD on stderr.
expect_config_error() {
  local field=$1
  shift
  "$@" >"$work/out" 2>"$work/err"
  local rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "configuration error" "$work/err" || ! grep -qF -- "$field" "$work/err"; then
    echo "FAIL (rc $rc, want 2 naming $field): $*" >&2
    cat "$work/err" >&2
    failures=$((failures + 1))
  fi
}

for bad in kvtc.bit_choices=0,14 kvtc.bit_choices=0,13 kvtc.bit_choices=0,16 kvtc.bit_choices=1,2 \
           kvtc.block=0 kvtc.threads=0 kvtc.basis_bits=12 kvtc.no_such_field=1 kvtc.beta=nan; do
  field=${bad%%=*}
  expect_config_error "$field" "$kvcodec" run --method kvtc --set "$bad" --max-tokens 2 --prompt "def f"
  expect_config_error "$field" "$kvcodec" compress --kv "$dump" -o "$work/x.kvc" --method kvtc --set "$bad"
done
expect_config_error int8.group_size "$kvcodec" run --method int8 --set int8.group_size=7 --max-tokens 2
expect_config_error palu.hi_bit "$kvcodec" compress --kv "$dump" -o "$work/x.kvc" --method palu --set palu.hi_bit=9
expect_config_error kivi2.residual "$kvcodec" run --method kivi2 --set kivi2.residual=-1 --max-tokens 2
expect_config_error "--set" "$kvcodec" run --method kvtc --set garbage --max-tokens 2
# run defaults to the shipped calibration (which fixes bit_choices); in local
# mode the widths themselves are refused, with the range the codec codes.
expect_config_error "integers in [0, 12]" "$kvcodec" run --method kvtc --set kvtc.mode=local \
  --set kvtc.bit_choices=0,14 --max-tokens 2 --prompt "def f"
# Every other command that takes --set checks it before any work (timeout:
# a serve that accepted the setting would never return).
bad="--set kvtc.mode=local --set kvtc.bit_choices=0,14"
expect_config_error kvtc.bit_choices timeout 60 "$kvcodec" serve --method kvtc $bad --port 0
expect_config_error kvtc.bit_choices "$kvcodec" eval --methods kvtc $bad --windows 1
expect_config_error kvtc.bit_choices "$kvcodec" bench --kv "$dump" --methods kvtc $bad
expect_config_error kvtc.bit_choices "$kvcodec" calibrate --tokens "$model/eval_tokens.u16" --windows 0-1 \
  --set kvtc.bit_choices=0,14 -o "$work/x.kvcal"
# A --set naming a method the command does not run (a typo of a method or a
# label; a label holding '.', which ends the method name) is refused.
expect_config_error int4.group_size "$kvcodec" run --method kvtc --set int4.group_size=8 --max-tokens 2
expect_config_error int4.group_size "$kvcodec" compress --kv "$dump" -o "$work/x.kvc" --method kvtc --set int4.group_size=8
expect_config_error int4.group_size "$kvcodec" bench --kv "$dump" --methods kvtc,zstd --set int4.group_size=8
expect_config_error int4.group_size timeout 60 "$kvcodec" serve --method kvtc --set int4.group_size=8 --port 0
expect_config_error kvtc:b.mode "$kvcodec" eval --methods fp16,kvtc:a --set kvtc:b.mode=local --windows 1
expect_config_error kvtc:t0.005 "$kvcodec" eval --methods fp16,kvtc:t0.005 --set kvtc:t0.005.mode=local --windows 1
# The stream-window sensitivity: a bad count, and a window without the
# sensitivity it changes (--cross-layer has it off unless asked for).
for bad in kvtc.sensitivity_window=-1 kvtc.sensitivity_window=x kvtc.sensitivity_block=0; do
  expect_config_error "${bad%%=*}" "$kvcodec" calibrate --tokens "$model/eval_tokens.u16" --windows 0-1 \
    --set "$bad" -o "$work/x.kvcal"
done
expect_config_error kvtc.sensitivity_window "$kvcodec" calibrate --tokens "$model/eval_tokens.u16" --windows 0-1 \
  --cross-layer --target-ratios 20 --set kvtc.sensitivity_window=16 -o "$work/x{}.kvcal"
expect_config_error kvtc.sensitivity_window "$kvcodec" calibrate --tokens "$model/eval_tokens.u16" --windows 0-1 \
  --set kvtc.sensitivity=none --set kvtc.target_ratio=10 --set kvtc.sensitivity_window=16 -o "$work/x.kvcal"

if [ "$failures" -gt 0 ]; then echo "bad_settings: $failures failures" >&2; exit 1; fi
echo "bad_settings: every bad setting exited 2 with a configuration error"

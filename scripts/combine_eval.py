#!/usr/bin/env python3
"""Combines `kvcodec eval --json` outputs of disjoint window ranges (same
--methods, e.g. --first-window 0 --windows 4 and --first-window 4 --windows 4
run as two processes) into one array with the fields of a single run:
NLL, KL and top-1 as means weighted by the scored predictions, ppl = exp(NLL),
compression ratio = summed fp16 bytes / summed stored bytes. With
--windows-per-part N also ppl_change_pct (against the first method, the
baseline) and ppl_change_se_pct, the standard error of the per-window change
over all windows, rebuilt from each part's N windows' spread and its pooled
change (standing in for its mean per-window change: approximate).

usage: scripts/combine_eval.py [--windows-per-part N] A.json B.json [...] > combined.json
"""
import json, math, sys

args = sys.argv[1:]
per_part = 0
if args[:1] == ["--windows-per-part"]:
    per_part, args = int(args[1]), args[2:]
runs = [json.load(open(path)) for path in args]
if not runs:
    sys.exit(__doc__)
combined = []
for i, first in enumerate(runs[0]):
    parts = [run[i] for run in runs]
    if any(p["method"] != first["method"] for p in parts):
        sys.exit(f"method {i} differs between the files: {[p['method'] for p in parts]}")
    n = sum(p["scored"] for p in parts)
    mean = lambda key: sum(p[key] * p["scored"] for p in parts) / n
    fp16 = sum(p["fp16_bytes"] for p in parts)
    stored = sum(p["compressed_bytes"] for p in parts)
    nll = mean("nll")
    combined.append({"method": first["method"], "scored": n, "nll": nll, "ppl": math.exp(nll), "kl": mean("kl"),
                     "top1_agreement": mean("top1_agreement"), "fp16_bytes": fp16, "compressed_bytes": stored,
                     "compression_ratio": fp16 / stored,
                     "tokens_per_s": sum(p["tokens_per_s"] for p in parts) / len(parts)})
if per_part:
    for i, c in enumerate(combined):
        parts = [run[i] for run in runs]
        c["ppl_change_pct"] = 100.0 * (c["ppl"] / combined[0]["ppl"] - 1.0)
        n, N = per_part, per_part * len(parts)
        ss = sum((n - 1) * n * p["ppl_change_se_pct"] ** 2 + n * (p["ppl_change_pct"] - c["ppl_change_pct"]) ** 2
                 for p in parts)
        c["ppl_change_se_pct"] = math.sqrt(ss / (N - 1) / N)
json.dump(combined, sys.stdout, indent=1)
print()

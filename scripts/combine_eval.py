#!/usr/bin/env python3
"""Combines `kvcodec eval --json` outputs of disjoint window ranges (same
--methods, e.g. --first-window 0 --windows 4 and --first-window 4 --windows 4
run as two processes) into one array with the fields of a single run:
NLL, KL and top-1 as means weighted by the scored predictions, ppl = exp(NLL),
compression ratio = summed fp16 bytes / summed stored bytes.

usage: scripts/combine_eval.py A.json B.json [...] > combined.json
"""
import json, math, sys

runs = [json.load(open(path)) for path in sys.argv[1:]]
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
json.dump(combined, sys.stdout, indent=1)
print()

#!/usr/bin/env python3
"""Ratio within a perplexity budget, read from a curve (issue 21).

Reads `kvcodec eval --json` outputs (one per window range, e.g. the choice
windows 8-15 and the report windows 0-7) whose methods are named
<series>:<tag><target> (e.g. kvtc:pl14, xkvtc:x20). Per series, the measured
points (ratio, ppl change) sorted by ratio are joined by straight lines, and
"ratio within B%" is where that curve first rises above B% (the largest
measured ratio if it never does, marked '>='; none if the first point is
already above). Prints one TSV row per point and one per series.

usage: scripts/ratio_curve.py [--budget 1.0] [--params LABEL=FILE ...] NAME=RUN.json [NAME=RUN.json ...]
"""
import json, os, re, sys

def crossing(points, budget):
    pts = sorted(points)
    if not pts or pts[0][1] > budget:
        return None, ""
    for (r0, c0), (r1, c1) in zip(pts, pts[1:]):
        if c1 > budget:
            return r0 + (r1 - r0) * (budget - c0) / (c1 - c0), ""
    return pts[-1][0], ">="

def main(argv):
    budget, params, runs = 1.0, {}, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--budget":
            budget = float(argv[i + 1]); i += 2; continue
        if a == "--params":
            label, path = argv[i + 1].split("=", 1)
            params[label] = os.path.getsize(path); i += 2; continue
        name, path = a.split("=", 1)
        runs.append((name, json.load(open(path))))
        i += 1
    if not runs:
        sys.exit(__doc__)
    print("windows\tmethod\tratio\tppl\tppl_change_pct\tse_pct\tkl\ttop1\tcalibration_bytes")
    series = {}
    for name, rows in runs:
        for m in rows:
            print(f"{name}\t{m['method']}\t{m['compression_ratio']:.2f}\t{m['ppl']:.4f}\t{m['ppl_change_pct']:+.2f}\t"
                  f"{m['ppl_change_se_pct']:.2f}\t{m['kl']:.4f}\t{m['top1_agreement']:.4f}\t{params.get(m['method'], '')}")
            if ":" in m["method"]:
                key = (name, m["method"].split(":")[0])
                series.setdefault(key, []).append((m["compression_ratio"], m["ppl_change_pct"]))
    print(f"\nwindows\tseries\tratio_within_{budget:g}pct (piecewise-linear curve through the points)")
    for (name, s), pts in series.items():
        r, mark = crossing(pts, budget)
        print(f"{name}\t{s}\t{'none' if r is None else f'{mark}{r:.2f}x'}")

if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env python3
"""Combines one-window `kvcodec eval --json` outputs (files named <job>_<window>.json,
as scripts/issue21_grid.sh writes them) over a window range, with the fields of
a single run: NLL, KL and top-1 as means weighted by the scored predictions,
ppl = exp(NLL), ratio = summed fp16 bytes / summed stored bytes, ppl change
against fp16 over the range, and its standard error from the per-window
changes (exact: every window is its own file). fp16 may come from another job's
file of the same window. Methods named <m>:<tag><target> where the tag is
letters-digits-then-letter (xkvtc:w8t18, xkvtc:w20b4t22) are renamed
<m>-<w8>:t18 (<m>-<w20b4>:t22), so that
scripts/ratio_curve.py reads one series per window setting.

usage: scripts/combine_windows.py DIR FIRST LAST > combined.json
"""
import glob, json, math, os, re, sys

if len(sys.argv) != 4:
    sys.exit(__doc__)
d, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
per = {}  # method -> window -> row
order = []
for path in sorted(glob.glob(os.path.join(d, "*_*.json"))):
    w = int(re.search(r"_(\d+)\.json$", path).group(1))
    if not first <= w <= last:
        continue
    for row in json.load(open(path)):
        if row["method"] not in per:
            order.append(row["method"])
        per.setdefault(row["method"], {})[w] = row
windows = range(first, last + 1)
for m, rows in per.items():
    missing = [w for w in windows if w not in rows]
    if missing:
        sys.exit(f"combine_windows: {m} lacks windows {missing}")
base = per.get("fp16")
if base is None:
    sys.exit("combine_windows: no fp16 rows (the baseline)")

def pooled(rows):
    n = sum(r["scored"] for r in rows)
    return sum(r["nll"] * r["scored"] for r in rows) / n, n

nll0, _ = pooled([base[w] for w in windows])
out = []
for m in order:
    rows = [per[m][w] for w in windows]
    nll, n = pooled(rows)
    mean = lambda key: sum(r[key] * r["scored"] for r in rows) / n
    changes = [100.0 * (per[m][w]["ppl"] / base[w]["ppl"] - 1.0) for w in windows]
    k = len(changes)
    mu = sum(changes) / k
    se = math.sqrt(sum((c - mu) ** 2 for c in changes) / (k - 1) / k) if k > 1 else 0.0
    fp16 = sum(r["fp16_bytes"] for r in rows)
    stored = sum(r["compressed_bytes"] for r in rows)
    name = re.sub(r"^([^:]+):([a-z]+\d[a-z0-9]*?)([a-z])(\d+)$", r"\1-\2:\3\4", m)
    out.append({"method": name, "scored": n, "nll": nll, "ppl": math.exp(nll),
                "ppl_change_pct": 100.0 * (math.exp(nll - nll0) - 1.0), "ppl_change_se_pct": se,
                "ppl_change_min_pct": min(changes), "ppl_change_max_pct": max(changes),
                "kl": mean("kl"), "top1_agreement": mean("top1_agreement"),
                "fp16_bytes": fp16, "compressed_bytes": stored, "compression_ratio": fp16 / stored,
                "resident_ratio": sum(r["resident_ratio"] for r in rows) / k,
                "tokens_per_s": sum(r["tokens_per_s"] for r in rows) / k})
json.dump(out, sys.stdout, indent=1)
print()

#!/usr/bin/env python3
"""Proxy estimates of two issue-21 levers on the shared KV dump, before
building them into the codec (docs/history/calibrated-sessions.md, "Levers by proxy").

Per tensor (keys with RoPE removed, values), each layer scaled to unit RMS
on the fit half, the 6 layers' heads concatenated (768 dims: one basis
across layers), PCA fitted on tokens 0-1023, measured on 1024-2047. Every
component gets the same uniform quantizer step (entropy-coded scalar
quantization, no allocation); rates are order-0 entropies of the measured
half's codes under tables counted on the fit half (+0.5 per symbol);
distortion is the squared error in the PCA space over the total energy.

1. Context entropy models: the entropy of a component's code given (a) the
   same component's code in the previous token (sign and magnitude up to 2),
   (b) how many of the token's earlier components are nonzero (5 classes),
   against order 0, at one step.
2. Quantizers: rate at equal distortion (interpolated over a sweep of steps)
   of (a) rounding to nearest with reconstruction at the lattice points (the
   codec's uniform quantizer), (b) the same codes reconstructed at each
   cell's centroid (per component, |code| 1, 2 and >= 3, from the fit half:
   a decoder-side table), (c) dead-zone rounding (threshold r < 0.5 toward
   zero) with centroid reconstruction.

This is not the codec (its DP bit allocation, bounded levels, per-layer
sensitivities); it says which lever is worth building. Needs numpy.
usage: scripts/issue21_levers_proxy.py [../shared/models/tinycode/kv_dump.safetensors]
"""
import json
import struct
import sys

import numpy as np


def read_dump(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])

    def get(name):
        a, b = header[name]["data_offsets"]
        return np.frombuffer(data[8 + n + a:8 + n + b], np.float16).astype(np.float64).reshape(header[name]["shape"])
    return get


def unrope(x, theta=10000.0):
    """x [H, S, D] post-RoPE (rotate_half) -> RoPE removed."""
    S, D = x.shape[1], x.shape[2]
    ang = np.arange(S)[:, None] * theta ** (-np.arange(0, D, 2) / D)[None, :]
    c, s = np.concatenate([np.cos(ang)] * 2, 1), np.concatenate([np.sin(ang)] * 2, 1)
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * c - rot * s


def coefficients(get, kind, layers=6):
    rows = []
    for l in range(layers):
        x = get(f"layers.{l}.{kind}")[0]
        if kind == "key":
            x = unrope(x)
        x = x.transpose(1, 0, 2).reshape(x.shape[1], -1)
        S = x.shape[0]
        rows.append(x / np.sqrt((x[:S // 2] ** 2).mean()))
    X = np.concatenate(rows, 1)
    A, B = X[:S // 2], X[S // 2:]
    mu = A.mean(0)
    w, U = np.linalg.eigh(np.cov((A - mu).T))
    U = U[:, ::-1]
    return (A - mu) @ U, (B - mu) @ U


def bits(train, test):
    vals, inv = np.unique(np.concatenate([train, test]), return_inverse=True)
    counts = np.bincount(inv[:len(train)], minlength=len(vals)) + 0.5
    return -np.log2((counts / counts.sum())[inv[len(train):]]).sum()


def conditional_bits(train, test, ctx_train, ctx_test):
    total = 0.0
    for c in np.unique(ctx_test):
        total += bits(train[ctx_train == c], test[ctx_test == c])
    return total


def quantize(z, step, r):
    return (np.sign(z) * np.floor(np.abs(z) / step + r)).astype(np.int64)


def rate_distortion(ZA, ZB, step, r, centroid):
    R = Dst = 0.0
    for k in range(ZA.shape[1]):
        a, b = ZA[:, k], ZB[:, k]
        qa, qb = quantize(a, step, r), quantize(b, step, r)
        if not qa.any() and not qb.any():
            Dst += (b ** 2).sum()
            continue
        rec = qb * step
        if centroid:
            for m in (1, 2, 3):
                sa = np.abs(qa) == m if m < 3 else np.abs(qa) >= 3
                sb = np.abs(qb) == m if m < 3 else np.abs(qb) >= 3
                if sa.any():
                    off = (np.abs(a[sa]) / step - np.abs(qa[sa])).mean()
                    rec[sb] = np.sign(qb[sb]) * (np.abs(qb[sb]) + off) * step
        Dst += ((b - rec) ** 2).sum()
        R += bits(qa, qb)
    return R, Dst


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "../shared/models/tinycode/kv_dump.safetensors"
    get = read_dump(path)
    for kind in ("key", "value"):
        ZA, ZB = coefficients(get, kind)
        total, n = (ZB ** 2).sum(), ZB.size
        # 1. context models at the step that gives ~8% distortion
        step = 1.0
        qa_all, qb_all = quantize(ZA, step, 0.5), quantize(ZB, step, 0.5)
        h0 = h_prev = h_count = 0.0
        for k in range(ZA.shape[1]):
            a, b = qa_all[:, k], qb_all[:, k]
            if not a.any() and not b.any():
                continue
            h0 += bits(a, b)
            prev = lambda q: np.clip(np.abs(np.r_[0, q[:-1]]), 0, 2) * np.sign(np.r_[0, q[:-1]])
            h_prev += conditional_bits(a, b, prev(a), prev(b))
            if k == 0:
                h_count += bits(a, b)
                continue
            ea, eb = (qa_all[:, :k] != 0).sum(1), (qb_all[:, :k] != 0).sum(1)
            mean = max(1.0, ea.mean())
            edges = [0.6 * mean, 0.85 * mean, 1.15 * mean, 1.5 * mean]
            h_count += conditional_bits(a, b, np.digitize(ea, edges), np.digitize(eb, edges))
        _, d1 = rate_distortion(ZA, ZB, step, 0.5, False)
        print(f"{kind}: step {step}, distortion {d1 / total:.3f}: order-0 {h0 / n:.3f} bits/element; "
              f"given the previous token's code {h_prev / n:.3f} ({100 * (1 - h_prev / h0):+.1f}% saved); "
              f"given the token's nonzero count so far {h_count / n:.3f} ({100 * (1 - h_count / h0):+.1f}%)")
        # 2. quantizers: rate at equal distortion
        curves = {}
        for name, r, centroid in (("nearest, lattice", 0.5, False), ("nearest, centroid", 0.5, True),
                                  ("dead zone 0.3, centroid", 0.3, True)):
            pts = sorted((d / total, rr / n) for rr, d in
                         (rate_distortion(ZA, ZB, float(np.exp(ls)), r, centroid) for ls in np.linspace(-1.0, 1.2, 23)))
            curves[name] = pts
        for target in (0.05, 0.10):
            base = np.interp(target, *zip(*curves["nearest, lattice"]))
            line = ", ".join(f"{name} {np.interp(target, *zip(*pts)):.3f} "
                             f"({100 * (1 - np.interp(target, *zip(*pts)) / base):+.1f}%)"
                             for name, pts in curves.items())
            print(f"{kind}: bits/element at distortion {target:.2f}: {line}")


if __name__ == "__main__":
    main()

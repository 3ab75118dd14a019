#!/usr/bin/env python3
"""Makes a head_dim-128 KV dump from a head_dim-64 one, for the speed bar at 128.

Each layer's two KV heads are put side by side as one head of 128 values:
key/value [1, 2, S, 64] -> [1, 1, S, 128], token t = head 0's row ++ head 1's
row. The queries follow so that the bench's attention error still means
something: query head j of the first GQA group and head j of the second,
[1, 6, Q, 64] -> [1, 3, Q, 128] (a score is then the sum of the two heads'
scores). Real model data, not a real 128-wide head: its PCA sees two
independent heads' statistics.

Usage: scripts/make_hd128_dump.py IN.safetensors OUT.safetensors
(e.g. ../shared/models/tinycode/kv_dump.safetensors /tmp/kv_dump_hd128.safetensors)
Plain Python, no numpy: the rows are byte slices.
"""
import json
import struct
import sys


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def pair_heads(blob, shape, itemsize, groups):
    """[1, H, S, D] -> [1, H / groups, S, D * groups]: output head j holds input
    heads j, j + H / groups, ... side by side."""
    b, h, s, d = shape
    if b != 1 or h % groups:
        sys.exit(f"make_hd128_dump: cannot pair heads of shape {shape}")
    per = h // groups
    row = d * itemsize
    out = bytearray()
    for j in range(per):
        for t in range(s):
            for g in range(groups):
                head = g * per + j
                off = (head * s + t) * row
                out += blob[off:off + row]
    return bytes(out), [1, per, s, d * groups]


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    header, data = read(sys.argv[1])
    meta = header.pop("__metadata__", {})
    sizes = {"F16": 2, "BF16": 2, "F32": 4, "I64": 8}
    out_header, chunks, pos = {}, [], 0
    for name, t in header.items():  # the input's order (data offsets ascending)
        begin, end = t["data_offsets"]
        blob = data[begin:end]
        shape = t["shape"]
        if name.endswith((".key", ".value")):
            if shape[1] != 2:
                sys.exit(f"make_hd128_dump: {name} has {shape[1]} KV heads, expected 2")
            blob, shape = pair_heads(blob, shape, sizes[t["dtype"]], 2)
        elif name.endswith(".query_last256"):
            blob, shape = pair_heads(blob, shape, sizes[t["dtype"]], 2)
        pad = (-len(blob)) % 8
        out_header[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [pos, pos + len(blob)]}
        chunks.append(blob + b"\0" * pad)
        pos += len(blob) + pad
    meta = dict(meta)
    meta["derived"] = "scripts/make_hd128_dump.py: the two KV heads of each layer side by side as one head"
    out_header["__metadata__"] = meta
    text = json.dumps(out_header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    with open(sys.argv[2], "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(c)


if __name__ == "__main__":
    main()

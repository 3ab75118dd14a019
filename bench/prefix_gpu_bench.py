#!/usr/bin/env python3
"""kvcodec.PrefixCodec on CUDA tensors from Python: encode and decode speed
against a device-to-device copy of the same bf16 bytes measured in the same
run, and the stored ratio (docs/python.md, "Whole prefixes on the GPU").

The KV is tinycode's real dump (shared/models/tinycode/kv_dump.safetensors,
2048 tokens per layer) tiled along the tokens to --tokens and over --batch
rows as offload_ttft.py tiles it (keys re-rotated to their positions); the codec is the shipped calibration's (models/tinycode/kvtc.kvcal),
sinks 4, window --window. Speeds count the bf16 bytes of the KV [2, B, S,
H_kv, D] per second, each the median of --repeats timed calls after one
warm-up, CUDA events around the calls (encode includes its stack into the
codec's layout and the wait for its size; decode its check for damaged
streams, a wait). Prints one JSON line per (layer, tokens).

usage: prefix_gpu_bench.py --dump KV_DUMP --calibration CAL [--tokens 2048,32768] [--batch 8]
"""
import argparse
import json
import statistics

import torch

import kvcodec
import offload_ttft


def tiled_kv(dump, layer, tokens, batch):
    """[batch, 2, tokens, 64] keys and values: the dump's layer tiled along
    the tokens (row b shifted by 131 b tokens), keys re-rotated to their new
    positions (offload_ttft.py's tiling, rows as batch)."""
    k, v = offload_ttft.tiled_layer(dump, layer, tokens)  # [1, 8, S, 128]
    rows = [(offload_ttft.as_codec_input(k)[b % 8], offload_ttft.as_codec_input(v)[b % 8]) for b in range(batch)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def timed(fn, repeats):
    times = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--layers", default="0,3")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--reconstruction", default="exact,tf32")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dump = offload_ttft.read_dump(a.dump)
    for layer in [int(x) for x in a.layers.split(",")]:
        for tokens in [int(x) for x in a.tokens.split(",")]:
            k, v = tiled_kv(dump, layer, tokens, a.batch)
            k, v = k.cuda(), v.cuda()
            for recon in a.reconstruction.split(","):
                codec = kvcodec.PrefixCodec(a.calibration, layer=layer, batch=a.batch, max_tokens=tokens,
                                            window=a.window, device="cuda", reconstruction=recon)
                kv_bytes = 2 * k.numel() * 2  # bf16 keys and values
                src = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                copy_s = timed(lambda: dst.copy_(src), a.repeats)
                enc = codec.encode(k, v)
                enc_s = timed(lambda: codec.encode(k, v), a.repeats)
                dec_s = timed(lambda: codec.decode(enc), a.repeats)
                k2, v2 = codec.decode(enc)
                kb = k.to(torch.bfloat16).float()
                rel = float(((kb - k2.float()) ** 2).sum() / (kb ** 2).sum())
                row = {"layer": layer, "tokens": tokens, "batch": a.batch, "reconstruction": recon,
                       "kv_bytes": kv_bytes, "stored_bytes": enc.nbytes, "ratio_vs_f16": round(enc.compression_ratio, 3),
                       "copy_gb_s": round(kv_bytes / copy_s / 1e9, 1), "encode_gb_s": round(kv_bytes / enc_s / 1e9, 1),
                       "decode_gb_s": round(kv_bytes / dec_s / 1e9, 1),
                       "encode_vs_copy": round(copy_s / enc_s, 4), "decode_vs_copy": round(copy_s / dec_s, 4),
                       "key_rel_sq_error": round(rel, 5)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Time to first token after a prefix comes back, measured end to end in one
torch process through kvcodec.PrefixCodec (docs/gpu.md, "Offload tier
through Python"; issue 20 items 3 and 4).

Model: a random-weight LlamaForCausalLM of Llama-3-8B's shape (32 layers,
hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256),
bf16, sdpa. KV: real tinycode KV, not the random model's (which is no data
for a codec): model layer l holds tinycode layer l mod 6; each of its 8 KV
heads is a [S, 128] row of tinycode's 2 KV heads x 64 concatenated (the
width the calibrated GPU format codes), the dump's 2048 tokens tiled with a
131-token shift per head, keys re-rotated to their new positions. Codec: the
shipped calibration, layer l mod 6, batch = the 8 heads, sinks 4, window 8.

Per token count S, each timed from the first byte moved until the first
token's id is on the host (median of --reps after a warm-up):
  (a) compressed: the 32 layers' payloads and offsets in pinned host memory
      are copied H2D on a copy stream, each layer's decode waits for its copy
      on the compute stream (copies overlap earlier decodes), the decoded
      keys and values go into a DynamicCache, one decode step;
  (b) uncompressed: the 32 layers' bf16 keys and values in pinned host
      memory copied H2D (non_blocking), into a DynamicCache, one step;
  (c) recompute: the prefill of S tokens (its last logits give the token).
Also: the stored bytes (payload + offsets) against f16, and that (a)'s
restored keys equal a CPU reference decode of the same host bytes (layer 0,
bit for bit). Prints one JSON line per S.

usage: offload_ttft.py --dump KV_DUMP --calibration CAL [--tokens 8192,32768] [--reps 5]
"""
import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

import kvcodec

HEADS, WIDTH, LAYERS = 8, 128, 32


def read_dump(path):
    import struct
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name.endswith(".key") or name.endswith(".value"):
            a, b = info["data_offsets"]
            out[name] = torch.from_numpy(np.frombuffer(data[8 + n + a:8 + n + b], np.float16)
                                         .reshape(info["shape"]).astype(np.float32))
    return out


def rope_tables(positions, dim, theta):
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = positions.double()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], 1).float(), torch.cat([ang.sin(), ang.sin()], 1).float()


def rotate(x, cos, sin, inverse):
    """rotate_half RoPE on the last dim of x [..., S, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos - rot * sin if inverse else x * cos + rot * sin


def tiled_layer(dump, layer, S, theta=10000.0):
    """Model layer `layer`'s keys and values [1, 8, S, 128] f32 (see the docstring)."""
    src = layer % 6
    k0, v0 = dump[f"layers.{src}.key"][0], dump[f"layers.{src}.value"][0]  # [2, 2048, 64]
    T = k0.shape[1]
    cos0, sin0 = rope_tables(torch.arange(T), 64, theta)
    k0 = rotate(k0, cos0, sin0, inverse=True)  # RoPE-free
    pos = torch.arange(S)
    cos, sin = rope_tables(pos, 64, theta)
    ks, vs = [], []
    for h in range(HEADS):
        idx = (pos + 131 * h) % T
        k = rotate(k0[:, idx], cos, sin, inverse=False)  # [2, S, 64] at positions 0..S-1
        ks.append(k.transpose(0, 1).reshape(S, WIDTH))
        vs.append(v0[:, idx].transpose(0, 1).reshape(S, WIDTH))
    return torch.stack(ks)[None], torch.stack(vs)[None]


def as_codec_input(x):
    """[1, 8, S, 128] -> the codec's [B=8, H_kv=2, S, D=64] view."""
    S = x.shape[2]
    return x[0].view(HEADS, S, 2, 64).transpose(1, 2)


def as_model_kv(k):
    """The codec's [8, 2, S, 64] output view -> [1, 8, S, 128] (a view)."""
    B, H, S, D = k.shape
    return k.transpose(1, 2).reshape(1, B, S, H * D)


def timed_ms(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--calibration", required=True)
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--reconstruction", default="exact,tf32", help="(a)'s decode: exact and/or tf32")
    a = ap.parse_args()
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    token_counts = [int(t) for t in a.tokens.split(",")]
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                      num_attention_heads=32, num_key_value_heads=HEADS, head_dim=WIDTH,
                      max_position_embeddings=max(token_counts) + 64, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    dump = read_dump(a.dump)
    cal = kvcodec.Calibration(a.calibration)
    g = torch.Generator(device="cuda").manual_seed(1)
    for S in token_counts:
        codecs = [kvcodec.PrefixCodec(cal, layer=l, batch=HEADS, max_tokens=S, sinks=4, window=8, device="cuda")
                  for l in range(6)]
        # Offload: every layer coded on the GPU, payload and offsets to pinned host memory.
        host_c, host_u, stored = [], [], 0
        for l in range(LAYERS):
            k, v = tiled_layer(dump, l, S)
            kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
            host_u.append((kb.pin_memory(), vb.pin_memory()))
            enc = codecs[l % 6].encode(as_codec_input(kb.cuda()), as_codec_input(vb.cuda()))
            p = torch.empty(enc.payload.numel(), dtype=torch.uint8, pin_memory=True)
            o = torch.empty(enc.offsets.numel(), dtype=torch.int64, pin_memory=True)
            p.copy_(enc.payload)
            o.copy_(enc.offsets)
            host_c.append((p, o, enc))
            stored += enc.nbytes
        f16_bytes = LAYERS * 2 * HEADS * S * WIDTH * 2
        copy_stream = torch.cuda.Stream()

        recon_codecs = {r: [kvcodec.PrefixCodec(cal, layer=l, batch=HEADS, max_tokens=S, sinks=4, window=8,
                                                device="cuda", reconstruction=r) for l in range(6)]
                        for r in a.reconstruction.split(",")}

        def restore_compressed(recon="exact"):
            codecs = recon_codecs[recon]
            events, dev = [], []
            with torch.cuda.stream(copy_stream):
                for p, o, _ in host_c:
                    dp, do = p.to("cuda", non_blocking=True), o.to("cuda", non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record()
                    dev.append((dp, do))
                    events.append(ev)
            cache = DynamicCache()
            main_stream = torch.cuda.current_stream()
            for l, ((dp, do), ev, (_, _, enc)) in enumerate(zip(dev, events, host_c)):
                main_stream.wait_event(ev)
                dp.record_stream(main_stream)
                do.record_stream(main_stream)
                e = kvcodec.EncodedPrefix(dp, do, enc.tokens, enc.batch, enc.n_kv_heads, enc.head_dim)
                k, v = codecs[l % 6].decode(e, check=False)
                cache.update(as_model_kv(k), as_model_kv(v), l)
            for c in codecs:
                c.check()
            return cache

        def restore_uncompressed():
            cache = DynamicCache()
            for l, (k, v) in enumerate(host_u):
                cache.update(k.to("cuda", non_blocking=True), v.to("cuda", non_blocking=True), l)
            return cache

        nxt = torch.randint(0, cfg.vocab_size, (1, 1), device="cuda", generator=g)
        prompt = torch.randint(0, cfg.vocab_size, (1, S), device="cuda", generator=g)

        def first_token(restore):
            def run():
                with torch.no_grad():
                    cache = restore()
                    logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
                    return int(logits[0, -1].argmax().item())
            return run

        def prefill():
            with torch.no_grad():
                logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1).logits
                return int(logits[0, -1].argmax().item())

        row = {"tokens": S, "layers": LAYERS, "f16_bytes": f16_bytes, "stored_bytes": stored,
               "ratio_vs_f16": round(f16_bytes / stored, 3)}
        variants = [(f"a_compressed_{r}", (lambda r=r: restore_compressed(r))) for r in recon_codecs]
        variants.append(("b_uncompressed", restore_uncompressed))
        for name, fn in [(n, first_token(f)) for n, f in variants] + [("c_recompute", prefill)]:
            times = [timed_ms(fn)[1] for _ in range(a.reps + 1)][1:]
            row[f"ttft_ms_{name}"] = round(statistics.median(times), 2)
            row[f"ttft_ms_{name}_range"] = [round(min(times), 2), round(max(times), 2)]
        for name, fn in variants:
            times = [timed_ms(fn)[1] for _ in range(a.reps + 1)][1:]
            row[f"restore_ms_{name}"] = round(statistics.median(times), 2)
            # The two parts of the TTFT apart: the restore, then (after a
            # wait) the step on the restored cache.
            parts = []
            for _ in range(a.reps + 1):
                with torch.no_grad():
                    cache, t_restore = timed_ms(fn)
                    _, t_step = timed_ms(lambda: int(model(input_ids=nxt, past_key_values=cache,
                                                           use_cache=True).logits[0, -1].argmax().item()))
                parts.append((t_restore, t_step))
                del cache
            row[f"split_ms_{name}"] = [round(statistics.median(p[i] for p in parts[1:]), 2) for i in (0, 1)]
        for r in recon_codecs:
            a_ttft, a_restore = row[f"ttft_ms_a_compressed_{r}"], row[f"restore_ms_a_compressed_{r}"]
            row[f"a_{r}_vs_b_ttft"] = round(row["ttft_ms_b_uncompressed"] / a_ttft, 2)
            row[f"a_{r}_vs_c_ttft"] = round(row["ttft_ms_c_recompute"] / a_ttft, 2)
            row[f"a_{r}_vs_b_restore"] = round(row["restore_ms_b_uncompressed"] / a_restore, 2)
            row[f"a_{r}_vs_c_restore"] = round(row["ttft_ms_c_recompute"] / a_restore, 2)
        # The restored layer 0 against the CPU reference decode of the same host bytes.
        cpu = kvcodec.PrefixCodec(cal, layer=0, batch=HEADS, max_tokens=S, sinks=4, window=8)
        p, o, enc = host_c[0]
        k_ref, _ = cpu.decode(kvcodec.EncodedPrefix(p.clone(), o.clone(), enc.tokens, enc.batch, enc.n_kv_heads,
                                                    enc.head_dim))
        restored = restore_compressed()
        k_gpu = restored.layers[0].keys if hasattr(restored, "layers") else restored.key_cache[0]
        row["layer0_keys_equal_cpu_reference"] = bool(torch.equal(k_gpu.cpu(), as_model_kv(k_ref)))
        k_in = host_u[0][0].float()
        row["layer0_key_rel_sq_error"] = round(float(((k_gpu.cpu().float() - k_in) ** 2).sum() / (k_in ** 2).sum()), 5)
        print(json.dumps(row), flush=True)
        del host_c, host_u, codecs, recon_codecs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

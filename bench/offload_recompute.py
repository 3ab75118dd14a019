#!/usr/bin/env python3
"""The recompute baseline of the offload tier (docs/gpu.md), on the GPU.

A random-weight LlamaForCausalLM of Llama-3-8B's shape (32 layers, hidden
4096, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256), bf16, sdpa
attention. Per token count S: the prefill of S random tokens (a real forward
that builds the KV cache and the first token's logits; median of REPS after
a warm-up) and one decode step of one token against the S-token cache (the
step that follows a restore; median of REPS + 2 after a warm-up, the cache
cropped back to S before each). One JSON line per token count.

Usage: offload_recompute.py TOKENS[,TOKENS...] [REPS=3]
"""
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) * 1e3


def main():
    tokens = [int(t) for t in sys.argv[1].split(",")]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=max(tokens) + 64, rope_theta=500000.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model, init_ms = timed(lambda: LlamaForCausalLM(cfg).eval())
    params = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        for S in tokens:
            ids = torch.randint(0, cfg.vocab_size, (1, S), device="cuda")

            def prefill():
                return model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

            out, _ = timed(prefill)
            prefill_ms = []
            for _ in range(reps):
                del out
                out, ms = timed(prefill)
                prefill_ms.append(ms)
            cache = out.past_key_values
            k0 = cache.layers[0].keys
            nxt = out.logits[:, -1:].argmax(-1)

            def step():
                cache.crop(S)
                return model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)

            timed(step)
            step_ms = [timed(step)[1] for _ in range(reps + 2)]
            print(json.dumps({
                "tokens": S, "model": "LlamaForCausalLM random weights, Llama-3-8B shape, bf16, sdpa",
                "params": params, "init_ms": round(init_ms, 1), "kv_layer0_keys_shape": list(k0.shape),
                "kv_dtype": str(k0.dtype), "prefill_ms": round(statistics.median(prefill_ms), 2),
                "prefill_all_ms": [round(x, 2) for x in prefill_ms],
                "decode_step_ms": round(statistics.median(step_ms), 3),
                "decode_step_all_ms": [round(x, 3) for x in step_ms],
                "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "transformers": transformers.__version__}), flush=True)
            del out, cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

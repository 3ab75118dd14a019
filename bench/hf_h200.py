"""kvcodec.hf.KVCodecCache inside Hugging Face transformers on a CUDA GPU:
the figures of docs/python.md ("On the H200").

This libkvcodec codes on the host, so every cache runs with
host_round_trip=True: each layer's new keys and values are copied to the
host and its reconstruction back at every step, counted (host_copy_bytes).

Parts (--parts, comma-separated):
  ppl    LlamaForCausalLM.from_pretrained(--model) in float32 through
         KVCodecCache, for each method (kvtc-gpu: KVCodecGpuCache, the
         history kept compressed on the GPU, sinks 4, window 32, blocks of
         64, needs a CUDA build of libkvcodec; palu-gpu: KVCodecGpuCache
         with method "palu", kvcodec.PaluBlockCache, palu's defaults), with
         `kvcodec eval`'s protocol
         (docs/eval.md): per window of --tokens, a prefill of --context
         tokens, then --score - 1 decode steps fed the true tokens; NLL of
         the --score tokens after the context; ppl = exp(mean NLL over all
         windows). Windows run in --workers processes (the codecs run on
         the host, one thread each); methods and settings as `kvcodec eval`
         gives them (kvtc: the model's calibration and kvtc.settings).
  gen    the model in float16: greedy generation of --gen-tokens tokens by
         model.generate() with DynamicCache and with KVCodecCache("fp16"):
         the same tokens.
  speed  a model of Llama-3-8B's shape (hidden 4096, 32 query / 8 KV heads
         of 128, MLP 14336, vocabulary 128256) with random bfloat16 weights
         and --speed-layers of its 32 layers: decode tokens/s and GPU memory
         after prefills of --contexts tokens, DynamicCache against
         KVCodecCache (--speed-methods; kvtc-gpu: KVCodecGpuCache, the
         history compressed in GPU memory, each 8B head coded as a row of
         tinycode's calibration: speed and bytes, not quality).

Writes one JSON object per result line to --out (and prints a summary).
"""
import argparse
import json
import math
import os
import sys
import time
import traceback


def log(*a):
    print(*a, flush=True)


# --- ppl ---------------------------------------------------------------------------

_worker = {}


def _ppl_init(model_dir):
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # f32 products in f32, as `kvcodec eval`'s runtime
    torch.backends.cudnn.allow_tf32 = False
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    _worker.update(model=model, model_dir=model_dir)


def _ppl_window(task):
    """NLL sum and count of one window through one method's caches."""
    import numpy as np
    import torch
    from kvcodec.hf import KVCodecCache

    method, settings, calibration, tokens_path, window, context, score = task
    model = _worker["model"]
    toks = np.fromfile(tokens_path, dtype=np.uint16).reshape(-1, 2048)[window].astype(np.int64)
    ids = torch.from_numpy(toks).cuda()
    if method == "kvtc-gpu":  # kept compressed on the GPU (kvcodec.BlockCache; a CUDA build of libkvcodec)
        from kvcodec.hf import KVCodecGpuCache
        kw = dict(x.split("=", 1) for x in settings.split(";") if x)
        cache = KVCodecGpuCache(calibration, max_tokens=context + score, config=model.config,
                                sinks=int(kw.get("sinks", 4)), window=int(kw.get("window", 32)),
                                block=int(kw.get("block", 64)), reconstruction=kw.get("reconstruction", "exact"))
    elif method == "palu-gpu":  # palu kept on the GPU (kvcodec.PaluBlockCache; fitted from a host copy once)
        from kvcodec.hf import KVCodecGpuCache
        cache = KVCodecGpuCache(max_tokens=context + score, config=model.config, method="palu", settings=settings)
    else:
        cache = KVCodecCache(method, settings, calibration=calibration, config=model.config, host_round_trip=True)
    t0 = time.time()
    nll = 0.0
    with torch.no_grad():
        logits = model(input_ids=ids[None, :context], past_key_values=cache, use_cache=True).logits[0, -1]
        for i in range(score):
            nll -= float(torch.log_softmax(logits.double(), -1)[ids[context + i]])
            if i + 1 < score:
                step = ids[context + i].view(1, 1)
                logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1]
    torch.cuda.synchronize()
    return {"method": method, "window": window, "nll_sum": nll, "count": score, "seconds": time.time() - t0,
            "compressed_bytes": cache.compressed_key_bytes + cache.compressed_value_bytes,
            "fp16_bytes": cache.fp16_key_bytes + cache.fp16_value_bytes, "host_copy_bytes": cache.host_copy_bytes}


def ppl_part(a, emit):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    cal = os.path.join(a.model, "kvtc.kvcal")
    methods = [("palu", "", None), ("kvtc", "sinks=4;window=8;refine=128", cal), ("kivi2", "", None),
               ("int4", "", None), ("int8", "", None), ("fp16", "", None),
               ("kvtc-gpu", "sinks=4;window=32;block=64", cal), ("palu-gpu", "", None)]
    methods = [m for m in methods if m[0] in a.methods.split(",")]
    tasks = [(m, s, c, a.tokens, w, a.context, a.score) for m, s, c in methods for w in range(a.windows)]
    os.environ["OMP_NUM_THREADS"] = "1"
    per = {}
    with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn"), initializer=_ppl_init,
                             initargs=(a.model,)) as pool:
        for r in pool.map(_ppl_window, tasks):
            emit(dict(part="ppl_window", **r))
            p = per.setdefault(r["method"], {"nll": 0.0, "n": 0, "c": 0, "f": 0, "s": 0.0, "h": 0})
            p["nll"] += r["nll_sum"]
            p["n"] += r["count"]
            p["c"] += r["compressed_bytes"]
            p["f"] += r["fp16_bytes"]
            p["s"] = max(p["s"], r["seconds"])
            p["h"] += r["host_copy_bytes"]
    for m, p in per.items():
        emit({"part": "ppl", "method": m, "windows": a.windows, "nll": p["nll"] / p["n"],
              "ppl": math.exp(p["nll"] / p["n"]), "ratio": p["f"] / p["c"] if p["c"] else None,
              "slowest_window_s": p["s"], "host_copy_bytes": p["h"]})


# --- gen ---------------------------------------------------------------------------


def gen_part(a, emit):
    import numpy as np
    import torch
    from transformers import DynamicCache, LlamaForCausalLM
    from kvcodec.hf import KVCodecCache

    model = LlamaForCausalLM.from_pretrained(a.model, dtype=torch.float16).cuda().eval()
    prompt = torch.from_numpy(np.fromfile(a.tokens, dtype=np.uint16)[:64].astype(np.int64)).cuda()[None]
    n = a.gen_tokens
    out = {}
    for name, cache in (("DynamicCache", DynamicCache()),
                        ("KVCodecCache fp16", KVCodecCache("fp16", config=model.config, host_round_trip=True))):
        t0 = time.time()
        with torch.no_grad():
            seq = model.generate(prompt, past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
        out[name] = seq[0, prompt.shape[1]:].tolist()
        emit({"part": "gen", "cache": name, "tokens": len(out[name]), "seconds": time.time() - t0,
              "host_copy_bytes": getattr(cache, "host_copy_bytes", 0)})
    a_, b_ = out["DynamicCache"], out["KVCodecCache fp16"]
    first = next((i for i, (x, y) in enumerate(zip(a_, b_)) if x != y), None)
    emit({"part": "gen_compare", "identical": a_ == b_, "tokens": len(a_), "first_difference": first})


# --- speed -------------------------------------------------------------------------


def rows_gpu_cache(calibration, max_tokens, block):
    """KVCodecGpuCache for the 8B shape's speed, with tinycode's calibration:
    each [S, 128] KV head of the model is coded as one row of the
    calibration's 2 x 64 (as bench/offload_ttft.py codes it), model layer l
    with calibration layer l mod 6, each model layer its own BlockCache.
    Speed and bytes only: a calibration of another model's KV says nothing
    about this one's quality (random weights here anyway)."""
    from kvcodec.hf import KVCodecGpuCache

    class RowsGpuCache(KVCodecGpuCache):
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            B, H, S, D = key_states.shape
            cal = self.calibration
            rows = lambda x: x.reshape(B * H, S, cal.n_kv_heads, cal.head_dim).transpose(1, 2)
            k, v = super().update(rows(key_states), rows(value_states), layer_idx, cache_kwargs)
            back = lambda x: x.transpose(1, 2).reshape(B, H, x.shape[2], D)
            return back(k), back(v)

        def _make_layer(self, key_states, layer_idx):
            return super()._make_layer(key_states, layer_idx, layer_idx % self.calibration.n_layers)

    return RowsGpuCache(calibration, max_tokens=max_tokens, block=block, window=32)


def speed_part(a, emit, deadline):
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    from kvcodec.hf import KVCodecCache

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.speed_layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    emit({"part": "speed_model", "layers": a.speed_layers, "weights_gib": weights / 2**30})
    g = torch.Generator(device="cuda").manual_seed(1)
    for ctx in [int(c) for c in a.contexts.split(",")]:
        prompt = torch.randint(0, cfg.vocab_size, (1, ctx), device="cuda", generator=g)
        for kind in ["DynamicCache"] + a.speed_methods.split(","):
            if time.time() > deadline:
                emit({"part": "speed", "context": ctx, "cache": kind, "skipped": "time budget"})
                continue
            if kind == "DynamicCache":
                cache = DynamicCache()
            elif kind == "kvtc-gpu":  # compressed in GPU memory (a CUDA build of libkvcodec)
                cache = rows_gpu_cache(os.path.join(a.model, "kvtc.kvcal"), ctx + a.decode_steps + 8, a.gpu_block)
            else:
                cache = KVCodecCache(kind, config=cfg, host_round_trip=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.no_grad():
                t0 = time.time()
                logits = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                torch.cuda.synchronize()
                prefill = time.time() - t0
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                copied = getattr(cache, "host_copy_bytes", 0)
                times = []
                for step in range(a.decode_steps + 1):  # the first step is a warm-up
                    t0 = time.time()
                    logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits
                    nxt = logits[:, -1].argmax(-1, keepdim=True)
                    torch.cuda.synchronize()
                    times.append(time.time() - t0)
            del logits
            held = torch.cuda.memory_allocated() - weights
            r = {"part": "speed", "context": ctx, "cache": kind, "prefill_s": prefill,
                 "decode_tok_per_s": len(times[1:]) / sum(times[1:]),
                 "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
                 "peak_over_weights_gib": (torch.cuda.max_memory_allocated() - weights) / 2**30,
                 "held_after_gib": held / 2**30}
            if kind != "DynamicCache":
                where = "gpu" if kind == "kvtc-gpu" else "host"
                r.update({"ratio": cache.compression_ratio, f"{where}_resident_mib": cache.resident_bytes / 2**20})
                r.update(
                         host_copy_gib_per_step=(cache.host_copy_bytes - copied) / 2**30 / len(times))
            emit(r)
            del cache
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF Llama folder (models/tinycode, with kvtc.kvcal)")
    p.add_argument("--tokens", required=True, help="eval_tokens.u16 (windows of 2048 uint16 tokens)")
    p.add_argument("--out", required=True, help="JSON lines written here")
    p.add_argument("--parts", default="ppl,gen,speed")
    p.add_argument("--methods", default="fp16,int8,int4,kivi2,palu,kvtc")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--score", type=int, default=512)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--speed-layers", type=int, default=4)
    p.add_argument("--speed-methods", default="fp16,int8,kvtc")
    p.add_argument("--gpu-block", type=int, default=1024, help="kvtc-gpu's block (tokens coded at once)")
    p.add_argument("--contexts", default="2048,8192,32768")
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the speed runs left after this many seconds")
    a = p.parse_args()
    start = time.time()
    out = open(a.out, "w")

    def emit(r):
        out.write(json.dumps(r) + "\n")
        out.flush()
        log(json.dumps(r))

    import torch
    import transformers
    emit({"part": "env", "torch": torch.__version__, "transformers": transformers.__version__,
          "gpu": torch.cuda.get_device_name(0), "python": sys.version.split()[0]})
    ok = True
    for part in a.parts.split(","):
        t0 = time.time()
        try:
            if part == "ppl":
                ppl_part(a, emit)
            elif part == "gen":
                gen_part(a, emit)
            elif part == "speed":
                speed_part(a, emit, start + a.budget_s)
            else:
                raise ValueError(f"unknown part {part!r}")
        except Exception:
            ok = False
            emit({"part": part, "error": traceback.format_exc()})
        log(f"== {part}: {time.time() - t0:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

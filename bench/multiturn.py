#!/usr/bin/env python3
"""Multi-turn benchmark of `kvcodec serve` prefix reuse (issue 6).

8 conversations x 4 turns, chat-style: turn 1 is a long document (Python
source from the standard library); each later turn's prompt is the previous
prompt, the model's reply and a short new message (about 64 tokens), so the
prompt grows to about 2000 tokens at turn 4. Turns are interleaved
across conversations (turn 1 of all, then turn 2 ...), so the store must keep
every conversation. The same run starts one server per configuration:

  fp16 with the prefix store and without it  -> time to first token (TTFT)
                                               and identical greedy outputs
  a compressed method (default kvtc) with and without the store
                                             -> TTFT and store bytes vs f16

Only the Python standard library. Usage:
  bench/multiturn.py --kvcodec build/kvcodec [--method kvtc] [--set kvtc.bit_budget=128] [--json out.json]
"""
import argparse, glob, json, os, re, statistics, subprocess, sys, time, urllib.request

def start(binary, args):
    p = subprocess.Popen([binary, "serve", "--port", "0"] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
        if m:
            return p, int(m.group(1))
    raise SystemExit("server did not start: " + " ".join(args))

def stop(p):
    p.terminate()
    p.wait(timeout=60)

def call(port, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())

def corpus():
    files = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    text = ""
    for f in files:
        try:
            t = open(f, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError):
            continue
        if len(t) > 4000 and t.isascii():
            text += t
        if len(text) > 400000:
            break
    return text

def run_config(binary, args, convs, turns, first_chars, add_chars, max_tokens):
    p, port = start(binary, args)
    try:
        prompts = [""] * convs
        results = [[None] * turns for _ in range(convs)]
        for t in range(turns):
            for c in range(convs):
                # Turn 1: a long document; later turns: a short new message each.
                base = c * (first_chars + turns * add_chars)
                src = CORPUS[base: base + first_chars] if t == 0 else \
                    CORPUS[base + first_chars + t * add_chars: base + first_chars + (t + 1) * add_chars]
                prompts[c] += src
                r = call(port, "/v1/completions", {"prompt": prompts[c], "max_tokens": max_tokens, "temperature": 0})
                text = r["choices"][0]["text"]
                results[c][t] = {"ttft_ms": r["kvcodec"]["ttft_ms"], "reused": r["kvcodec"]["reused_prompt_tokens"],
                                 "prompt_tokens": r["usage"]["prompt_tokens"], "text": text}
                prompts[c] += text
        stats = call(port, "/v1/kv/stats")
    finally:
        stop(p)
    return results, stats

def summary(name, results, stats):
    later = [r["ttft_ms"] for conv in results for r in conv[1:]]
    first = [conv[0]["ttft_ms"] for conv in results]
    ps, ret = stats["prefix_store"], stats["retained"]["total"]
    out = {"config": name, "ttft_turn1_mean_ms": statistics.mean(first), "ttft_turns2_4_mean_ms": statistics.mean(later),
           "reused_tokens_mean_turns2_4": statistics.mean(r["reused"] for conv in results for r in conv[1:]),
           "prompt_tokens_turn4_mean": statistics.mean(conv[-1]["prompt_tokens"] for conv in results),
           "store_entries": ps["entries"], "store_bytes": ps["bytes"], "store_hit_rate": ps["hit_rate"],
           "store_fp16_bytes": ret["fp16_bytes"], "store_cache_ratio": ret["ratio"],
           "store_bytes_vs_fp16": (ret["fp16_bytes"] / ps["bytes"]) if ps["bytes"] else 0.0,
           "rss_mib": stats["memory"]["rss_bytes"] / 2**20}
    print(f"{name:>22}: TTFT turn 1 {out['ttft_turn1_mean_ms']:8.1f} ms, turns 2-4 {out['ttft_turns2_4_mean_ms']:8.1f} ms "
          f"(reused {out['reused_tokens_mean_turns2_4']:.0f} tokens), turn-4 prompt {out['prompt_tokens_turn4_mean']:.0f} tokens; "
          f"store {ps['entries']} entries {ps['bytes']/2**20:.2f} MiB vs f16 {ret['fp16_bytes']/2**20:.2f} MiB "
          f"({out['store_bytes_vs_fp16']:.2f}x), hit rate {ps['hit_rate']:.2f}, RSS {out['rss_mib']:.0f} MiB", flush=True)
    return out

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcodec", default="build/kvcodec")
    ap.add_argument("--method", default="kvtc")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--target-tokens", type=int, default=1950, help="turn-4 prompt length, about")
    ap.add_argument("--message-tokens", type=int, default=64, help="new user text per later turn, about")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    global CORPUS
    CORPUS = corpus()
    common = ["--max-tokens-limit", str(a.max_tokens)]
    store = ["--prefix-store-bytes", str(512 << 20)]
    if a.threads:
        common += ["--threads", str(a.threads)]
    # Characters per token of this text, measured, so turn 4 lands near the target.
    p, port = start(a.kvcodec, common + ["--prefix-store-bytes", "0"])
    probe = CORPUS[:4000]
    n = call(port, "/v1/completions", {"prompt": probe, "max_tokens": 0})["usage"]["prompt_tokens"]
    stop(p)
    cpt = len(probe) / n
    add_chars = int(a.message_tokens * cpt)
    first_tokens = a.target_tokens - a.turns * a.max_tokens - (a.turns - 1) * a.message_tokens
    first_chars = int(first_tokens * cpt)
    print(f"{a.conversations} conversations x {a.turns} turns, turn 1 {first_chars} characters, then {add_chars} new characters per turn "
          f"({len(probe)/n:.2f} chars/token), max_tokens {a.max_tokens}", flush=True)
    sets = sum((["--set", s] for s in a.set), [])
    configs = [("fp16 reuse", ["--method", "fp16"] + store), ("fp16 no-reuse", ["--method", "fp16", "--prefix-store-bytes", "0"]),
               (f"{a.method} reuse", ["--method", a.method] + store + sets),
               (f"{a.method} no-reuse", ["--method", a.method, "--prefix-store-bytes", "0"] + sets)]
    runs = {}
    for name, args in configs:
        results, stats = run_config(a.kvcodec, common + args, a.conversations, a.turns, first_chars, add_chars, a.max_tokens)
        runs[name] = (results, summary(name, results, stats))
    fp_r, fp_n = runs["fp16 reuse"], runs["fp16 no-reuse"]
    same = all(x["text"] == y["text"] for cr, cn in zip(fp_r[0], fp_n[0]) for x, y in zip(cr, cn))
    cm_r, cm_n = runs[f"{a.method} reuse"], runs[f"{a.method} no-reuse"]
    report = {
        "fp16_ttft_speedup_turns2_4": fp_n[1]["ttft_turns2_4_mean_ms"] / fp_r[1]["ttft_turns2_4_mean_ms"],
        f"{a.method}_ttft_speedup_turns2_4": cm_n[1]["ttft_turns2_4_mean_ms"] / cm_r[1]["ttft_turns2_4_mean_ms"],
        f"{a.method}_store_bytes_vs_fp16": cm_r[1]["store_bytes_vs_fp16"],
        "fp16_outputs_equal_with_and_without_reuse": same,
        "configs": [v[1] for v in runs.values()],
    }
    print(f"TTFT speedup from reuse (turns 2-4): fp16 {report['fp16_ttft_speedup_turns2_4']:.1f}x, "
          f"{a.method} {report[a.method + '_ttft_speedup_turns2_4']:.1f}x; "
          f"{a.method} store bytes {report[a.method + '_store_bytes_vs_fp16']:.1f}x below f16; "
          f"fp16 outputs equal with and without reuse: {same}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = report["fp16_ttft_speedup_turns2_4"] >= 5 and report[f"{a.method}_store_bytes_vs_fp16"] >= 8 and same
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())

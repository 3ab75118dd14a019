#!/usr/bin/env python3
"""Multi-turn benchmark of `kvcodec serve` prefix reuse (issue 6).

8 conversations x 4 turns through /v1/chat/completions. Turn 1's user
message is a long document (Python source from the standard library); each
later turn sends the whole conversation back (the earlier messages, the
model's replies as it gave them) plus a new user message, so turn 4's prompt
is close to --target-tokens (default 2000; the model context is 2048).

Prompt sizes come from the server's own token counts (POST /tokenize, the
same encoding a request gets), never from a characters-per-token estimate:
turn t's prompt is the largest one of at most target - (turns-1-t) * step
tokens, step = --message-tokens + max_tokens + 8 (role framing), found by
bisecting the new message's length. Every request's usage.prompt_tokens is
checked against the context (prompt + max_tokens <= context).

Turns are interleaved across conversations (turn 1 of all, then turn 2 ...),
so the store must keep every conversation. One server per configuration, all
in the same run:

  fp16 with the prefix store and without it  -> time to first token (TTFT)
                                               and identical greedy outputs
  a compressed method (--method, default kvtc) with the store, and without it
  (unless --no-compressed-baseline)          -> TTFT, store bytes vs f16

Only the Python standard library. Usage:
  bench/multiturn.py --kvcodec build/kvcodec --method kvtc --set kvtc.calibration=FILE --threads 1 --json out.json
Exits non-zero unless fp16 reuse is >= 5x faster to the first token on turns
2-4, the compressed store is >= 8x below f16 and the fp16 outputs are equal.
"""
import argparse, glob, json, statistics, sys, time

from kvserver import request, start, stop


def call(port, path, body=None):
    status, reply = request(port, path, body, timeout=900)
    if status != 200:
        raise SystemExit(f"{path} answered {status}: {reply.decode(errors='replace')}")
    return json.loads(reply)


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
        if len(text) > 600000:
            break
    return text


def fit_message(port, messages, source, target):
    """Longest prefix of `source` that, as a new user message after
    `messages`, keeps the prompt at most `target` tokens (server counts)."""
    def count(n):
        return call(port, "/tokenize", {"messages": messages + [{"role": "user", "content": source[:n]}]})["count"]
    lo, hi = 0, len(source)
    if count(lo) > target:
        raise SystemExit(f"the conversation alone is over {target} tokens; lower --message-tokens or raise --target-tokens")
    while lo < hi:  # largest n with count(n) <= target
        mid = (lo + hi + 1) // 2
        if count(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return source[:lo]


def run_config(binary, args, a, context):
    p, port = start(binary, args)
    step = a.message_tokens + a.max_tokens + 8
    try:
        convs = [[] for _ in range(a.conversations)]  # messages so far
        cursor = [c * a.conversation_chars for c in range(a.conversations)]
        results = [[None] * a.turns for _ in range(a.conversations)]
        for t in range(a.turns):
            target = a.target_tokens - (a.turns - 1 - t) * step
            for c in range(a.conversations):
                source = CORPUS[cursor[c]: cursor[c] + 16 * target]
                msg = fit_message(port, convs[c], source, target)
                cursor[c] += len(msg)
                convs[c].append({"role": "user", "content": msg})
                t0 = time.perf_counter()
                r = call(port, "/v1/chat/completions", {"messages": convs[c], "max_tokens": a.max_tokens, "temperature": 0})
                wall = (time.perf_counter() - t0) * 1000
                n = r["usage"]["prompt_tokens"]
                if n > target or n + a.max_tokens > context:
                    raise SystemExit(f"conversation {c} turn {t + 1}: prompt {n} tokens, over {target} or context {context}")
                text = r["choices"][0]["message"]["content"]
                convs[c].append({"role": "assistant", "content": text})
                k = r["kvcodec"]
                results[c][t] = {"ttft_ms": k["ttft_ms"], "reused": k["reused_prompt_tokens"],
                                 "load_ms": k.get("prefix_load_ms", 0.0), "wall_ms": wall,
                                 "prompt_tokens": n, "completion_tokens": r["usage"]["completion_tokens"], "text": text}
        stats = call(port, "/v1/kv/stats")
    finally:
        stop(p)
    return results, stats


def summary(name, results, stats):
    later = [r for conv in results for r in conv[1:]]
    first = [conv[0] for conv in results]
    ps, ret = stats["prefix_store"], stats["retained"]["total"]
    mean = statistics.mean
    out = {"config": name,
           "ttft_turn1_mean_ms": mean(r["ttft_ms"] for r in first),
           "ttft_turns2_4_mean_ms": mean(r["ttft_ms"] for r in later),
           "prompt_tokens_turns2_4_mean": mean(r["prompt_tokens"] for r in later),
           "reused_tokens_turns2_4_mean": mean(r["reused"] for r in later),
           "reused_fraction_turns2_4": sum(r["reused"] for r in later) / sum(r["prompt_tokens"] for r in later),
           "prefix_load_ms_turns2_4_mean": mean(r["load_ms"] for r in later),
           "prompt_tokens_turn1": [r["prompt_tokens"] for r in first],
           "prompt_tokens_last_turn": [conv[-1]["prompt_tokens"] for conv in results],
           "completion_tokens_total": sum(r["completion_tokens"] for conv in results for r in conv),
           "request_wall_mean_ms": mean(r["wall_ms"] for conv in results for r in conv),
           "store_entries": ps["entries"], "store_bytes": ps["bytes"], "store_hit_rate": ps["hit_rate"],
           "store_superseded": ps.get("superseded", 0), "store_evictions": ps["evictions"],
           "store_fp16_bytes": ret["fp16_bytes"], "store_cache_ratio": ret["ratio"],
           "store_bytes_vs_fp16": (ret["fp16_bytes"] / ps["bytes"]) if ps["bytes"] else 0.0,
           "rss_mib": stats["memory"]["rss_bytes"] / 2**20}
    print(f"{name:>16}: TTFT turn 1 {out['ttft_turn1_mean_ms']:8.1f} ms, turns 2-4 {out['ttft_turns2_4_mean_ms']:8.1f} ms "
          f"(reused {out['reused_tokens_turns2_4_mean']:.0f} of {out['prompt_tokens_turns2_4_mean']:.0f} tokens, "
          f"{100 * out['reused_fraction_turns2_4']:.1f}%; prefix load {out['prefix_load_ms_turns2_4_mean']:.1f} ms); "
          f"turn-1 prompts {min(out['prompt_tokens_turn1'])}-{max(out['prompt_tokens_turn1'])}, last-turn prompts "
          f"{min(out['prompt_tokens_last_turn'])}-{max(out['prompt_tokens_last_turn'])} tokens; "
          f"store {ps['entries']} entries {ps['bytes']/2**20:.2f} MiB vs f16 {ret['fp16_bytes']/2**20:.2f} MiB "
          f"({out['store_bytes_vs_fp16']:.2f}x), hit rate {ps['hit_rate']:.2f}, RSS {out['rss_mib']:.0f} MiB", flush=True)
    return out


def agreement(xs, ys):
    """Replies equal, and the mean length of the common character prefix relative to the reply."""
    pairs = [(x["text"], y["text"]) for cx, cy in zip(xs, ys) for x, y in zip(cx, cy)]
    equal = sum(x == y for x, y in pairs)
    def common(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n / max(1, len(y))
    return equal, len(pairs), statistics.mean(common(x, y) for x, y in pairs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcodec", default="build/kvcodec")
    ap.add_argument("--method", default="kvtc")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--target-tokens", type=int, default=2000, help="last turn's prompt, at most")
    ap.add_argument("--message-tokens", type=int, default=64, help="new user text per later turn, about")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--conversation-chars", type=int, default=60000, help="corpus characters set aside per conversation")
    ap.add_argument("--no-compressed-baseline", action="store_true", help="skip the compressed method without the store")
    ap.add_argument("--json")
    a = ap.parse_args()
    global CORPUS
    CORPUS = corpus()
    if len(CORPUS) < a.conversations * a.conversation_chars:
        raise SystemExit("not enough Python source under /usr/lib/python3* for the corpus")
    common = ["--max-tokens-limit", str(a.max_tokens), "--threads", str(a.threads)]
    store = ["--prefix-store-bytes", str(512 << 20)]
    p, port = start(a.kvcodec, common + ["--prefix-store-bytes", "0"])
    info = call(port, "/tokenize", {"prompt": ""})
    stop(p)
    context = info["max_model_len"]
    if a.target_tokens + a.max_tokens > context or a.target_tokens > info["max_prompt_tokens"]:
        raise SystemExit(f"--target-tokens {a.target_tokens} + --max-tokens {a.max_tokens} must fit the context {context}")
    print(f"{a.conversations} conversations x {a.turns} turns, last-turn prompts <= {a.target_tokens} tokens "
          f"(context {context}), ~{a.message_tokens} new tokens per later turn, max_tokens {a.max_tokens}, "
          f"threads {a.threads}", flush=True)
    sets = sum((["--set", s] for s in a.set), [])
    configs = [("fp16 reuse", ["--method", "fp16"] + store), ("fp16 no-reuse", ["--method", "fp16", "--prefix-store-bytes", "0"]),
               (f"{a.method} reuse", ["--method", a.method] + store + sets)]
    if not a.no_compressed_baseline:
        configs.append((f"{a.method} no-reuse", ["--method", a.method, "--prefix-store-bytes", "0"] + sets))
    runs = {}
    t_start = time.time()
    for name, args in configs:
        results, stats = run_config(a.kvcodec, common + args, a, context)
        runs[name] = (results, summary(name, results, stats))
    fp_r, fp_n = runs["fp16 reuse"], runs["fp16 no-reuse"]
    eq, total, _ = agreement(fp_r[0], fp_n[0])
    same = eq == total
    cm_r = runs[f"{a.method} reuse"]
    # Quality cost of the compressed method: its turn-1 replies (same prompts
    # as fp16's, no reuse involved) against fp16's.
    cq_eq, cq_n, cq_common = agreement([c[:1] for c in cm_r[0]], [c[:1] for c in fp_n[0]])
    report = {
        "fp16_ttft_speedup_turns2_4": fp_n[1]["ttft_turns2_4_mean_ms"] / fp_r[1]["ttft_turns2_4_mean_ms"],
        f"{a.method}_store_bytes_vs_fp16": cm_r[1]["store_bytes_vs_fp16"],
        "fp16_outputs_equal_with_and_without_reuse": same,
        "fp16_replies_equal": f"{eq}/{total}",
        f"{a.method}_turn1_replies_equal_to_fp16": f"{cq_eq}/{cq_n}",
        f"{a.method}_turn1_reply_common_prefix_vs_fp16": cq_common,
        "seconds": time.time() - t_start,
        "args": vars(a),
        "configs": [v[1] for v in runs.values()],
    }
    line = (f"TTFT speedup from reuse (turns 2-4): fp16 {report['fp16_ttft_speedup_turns2_4']:.1f}x")
    if f"{a.method} no-reuse" in runs:
        cm_n = runs[f"{a.method} no-reuse"]
        report[f"{a.method}_ttft_speedup_turns2_4"] = cm_n[1]["ttft_turns2_4_mean_ms"] / cm_r[1]["ttft_turns2_4_mean_ms"]
        line += f", {a.method} {report[a.method + '_ttft_speedup_turns2_4']:.1f}x"
    line += (f"; {a.method} store bytes {report[a.method + '_store_bytes_vs_fp16']:.2f}x below f16; "
             f"fp16 replies equal with and without reuse: {eq}/{total}; {a.method} turn-1 replies equal to fp16's: "
             f"{cq_eq}/{cq_n} (common prefix {100 * cq_common:.0f}%); {report['seconds']:.0f} s")
    print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = report["fp16_ttft_speedup_turns2_4"] >= 5 and report[f"{a.method}_store_bytes_vs_fp16"] >= 8 and same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

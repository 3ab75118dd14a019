#!/usr/bin/env python3
"""Two `kvcodec serve` processes, one Redis prefix store (issue 19).

multiturn (default): server A plays 8 conversations x 4 turns (bench/multiturn.py's
conversations, each turn extending the previous); server B then gets exactly
the same requests, so every prefix B needs was first computed by A; a server
without a store gets them too (recomputing). Reports the median time to first
token (server-side) of B against recomputing, whether the fp16 greedy replies
of A, B and the reference are equal, and Redis's used memory (INFO, minus the
empty Redis's) per stored token against f16 bytes per token, beside the
cache's own compression ratio. With --method kvtc the memory figures are for
that method (TTFT and equality are for fp16).

fault: 16 clients for --seconds against A and B (alternating), prompts from a
fixed set whose reference replies come from a server without a store; Redis
(AOF persistence) is SIGKILLed at 40% of the run and restarted 10 s later.
Reports the status codes, replies differing from the reference, and the hit
rate per second around the outage.

Only the Python standard library and redis-server. Usage:
  bench/redis_store.py --kvcodec build/kvcodec multiturn [--method kvtc --set ...]
  bench/redis_store.py --kvcodec build/kvcodec fault
"""
import argparse, json, os, shutil, socket, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(__file__))
import multiturn
from kvserver import request, start, stop


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Redis:
    def __init__(self, persist):
        self.port, self.dir, self.persist, self.p = free_port(), tempfile.mkdtemp(prefix="kvcodec_redis_"), persist, None

    def start(self):
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
                "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru",
                "--appendonly", "yes" if self.persist else "no", "--appendfsync", "everysec"]
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        for _ in range(200):
            if self.cli("PING") == "PONG":
                return
            time.sleep(0.02)
        raise SystemExit("redis-server did not start")

    def cli(self, *args):
        r = subprocess.run(["redis-cli", "-p", str(self.port)] + list(args), capture_output=True, text=True)
        return r.stdout.strip()

    def used_memory(self):
        for line in self.cli("INFO", "memory").splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":")[1])
        return 0

    def kill(self):
        self.p.kill()
        self.p.wait()

    def close(self):
        if self.p and self.p.poll() is None:
            self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def chat(port, messages, max_tokens):
    return multiturn.call(port, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0})


def conversations_on(port, a):
    """Plays the conversations on one server; returns every request (messages) and its reply."""
    step = a.message_tokens + a.max_tokens + 8
    convs = [[] for _ in range(a.conversations)]
    cursor = [c * a.conversation_chars for c in range(a.conversations)]
    done = []
    for t in range(a.turns):
        target = a.target_tokens - (a.turns - 1 - t) * step
        for c in range(a.conversations):
            msg = multiturn.fit_message(port, convs[c], multiturn.CORPUS[cursor[c]: cursor[c] + 16 * target], target)
            cursor[c] += len(msg)
            convs[c].append({"role": "user", "content": msg})
            r = chat(port, convs[c], a.max_tokens)
            done.append((list(convs[c]), r))
            convs[c].append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return done


def replay(port, done, a):
    return [chat(port, msgs, a.max_tokens) for msgs, _ in done]


def text(r):
    return r["choices"][0]["message"]["content"]


def multiturn_run(a, common):
    multiturn.CORPUS = multiturn.corpus()
    redis = Redis(persist=False)
    redis.start()
    store = ["--prefix-store", f"redis://127.0.0.1:{redis.port}", "--prefix-chunk", str(a.chunk)]
    report = {"args": vars(a)}
    try:
        methods = ([] if a.no_fp16 else [("fp16", [])]) + ([(a.method, a.set)] if a.method != "fp16" else [])
        for method, sets in methods:
            redis.cli("FLUSHALL")
            empty = redis.used_memory()
            margs = common + ["--method", method] + sum((["--set", s] for s in sets), [])
            pa, port_a = start(a.kvcodec, margs + store)
            pb, port_b = start(a.kvcodec, margs + store)
            try:
                done = conversations_on(port_a, a)
                on_b = replay(port_b, done, a)
                sa, sb = multiturn.call(port_a, "/v1/kv/stats"), multiturn.call(port_b, "/v1/kv/stats")
            finally:
                stop(pa)
                stop(pb)
            used = redis.used_memory() - empty
            tokens = sa["tokens"]["retained"] + sb["tokens"]["retained"]
            ret = [s["retained"]["total"] for s in (sa, sb)]
            fp16_b = sum(r["fp16_bytes"] for r in ret)
            comp_b = sum(r["compressed_bytes"] for r in ret)
            res = {"redis_used_bytes": used, "stored_tokens": tokens,
                   "redis_bytes_per_token": used / tokens if tokens else 0,
                   "f16_bytes_per_token": fp16_b / tokens if tokens else 0,
                   "f16_vs_redis": (fp16_b / used) if used else 0, "cache_ratio": fp16_b / comp_b if comp_b else 0,
                   "chunks": sa["prefix_store"]["entries"] + sb["prefix_store"]["entries"],
                   "b_hits": sb["prefix_store"]["hits"], "b_lookups": sb["prefix_store"]["lookups"],
                   "b_reused_fraction": sum(r["kvcodec"]["reused_prompt_tokens"] for r in on_b) /
                                        sum(r["usage"]["prompt_tokens"] for r in on_b)}
            res["redis_vs_cache_ratio"] = res["f16_vs_redis"] / res["cache_ratio"] if res["cache_ratio"] else 0
            # The chunk values' own bytes (the servers' accounting), apart from Redis's allocator and key overhead.
            values = sa["prefix_store"]["bytes_stored"] + sb["prefix_store"]["bytes_stored"]
            res["value_bytes"] = values
            res["values_vs_cache_ratio"] = (fp16_b / values) / res["cache_ratio"] if values and res["cache_ratio"] else 0
            if method == "fp16":
                pr, port_r = start(a.kvcodec, margs + ["--prefix-store-bytes", "0"])
                try:
                    ref = replay(port_r, done, a)
                finally:
                    stop(pr)
                ttft_b = [r["kvcodec"]["ttft_ms"] for r in on_b]
                ttft_r = [r["kvcodec"]["ttft_ms"] for r in ref]
                res.update({"ttft_b_median_ms": statistics.median(ttft_b), "ttft_recompute_median_ms": statistics.median(ttft_r),
                            "ttft_ratio": statistics.median(ttft_r) / statistics.median(ttft_b),
                            "replies_equal_b_vs_reference": f"{sum(text(x) == text(y) for x, y in zip(on_b, ref))}/{len(ref)}",
                            "replies_equal_a_vs_reference": f"{sum(text(x[1]) == text(y) for x, y in zip(done, ref))}/{len(ref)}",
                            "prompt_tokens": [min(r['usage']['prompt_tokens'] for r in ref), max(r['usage']['prompt_tokens'] for r in ref)]})
            report[method] = res
            print(method, json.dumps(res), flush=True)
    finally:
        redis.close()
    return report


def fault_run(a, common):
    redis = Redis(persist=True)
    redis.start()
    store = ["--prefix-store", f"redis://127.0.0.1:{redis.port}", "--prefix-chunk", str(a.chunk)]
    prompts = [("".join(f"def f{i}_{v}(x):\n    return x * {i + v}\n" for i in range(a.fault_lines))) for v in range(a.fault_prompts)]
    body = lambda p: {"prompt": p, "max_tokens": 4, "temperature": 0}
    pr, port_r = start(a.kvcodec, common + ["--method", "fp16", "--prefix-store-bytes", "0"])
    try:
        ref = [json.loads(request(port_r, "/v1/completions", body(p), timeout=600)[1])["choices"][0]["text"] for p in prompts]
    finally:
        stop(pr)
    servers = [start(a.kvcodec, common + ["--method", "fp16", "--max-queue", "16"] + store) for _ in range(2)]
    log, lock, t0 = [], threading.Lock(), time.time()

    def client(k):
        i = k
        while time.time() - t0 < a.seconds:
            port = servers[i % 2][1]
            status, reply = request(port, "/v1/completions", body(prompts[i % len(prompts)]), timeout=120)
            r = json.loads(reply) if status == 200 else {}
            with lock:
                log.append((time.time() - t0, status, i % len(prompts),
                            r.get("choices", [{}])[0].get("text"), r.get("kvcodec", {}).get("reused_prompt_tokens", 0)))
            i += 7

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    kill_at = a.seconds * 0.4
    time.sleep(kill_at)
    redis.kill()
    t_kill = time.time() - t0
    time.sleep(10)
    redis.start()
    t_back = time.time() - t0
    for t in threads:
        t.join()
    for p, _ in servers:
        stop(p)
    redis.close()
    statuses = {}
    for _, s, *_ in log:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    wrong = sum(1 for _, s, i, txt, _ in log if s == 200 and txt != ref[i])
    def rate(lo, hi):
        xs = [reused > 0 for t, s, _, _, reused in log if lo <= t < hi and s == 200]
        return (sum(xs) / len(xs) if xs else None, len(xs))
    per_second = [{"t": s, "hit_rate": rate(s, s + 1)[0], "answers": rate(s, s + 1)[1]} for s in range(int(a.seconds) + 1)]
    report = {"statuses": statuses, "wrong_replies": wrong, "answers": len(log), "redis_killed_at_s": t_kill,
              "redis_back_at_s": t_back, "hit_rate_before_kill": rate(5, t_kill)[0], "hit_rate_while_down": rate(t_kill + 1, t_back)[0],
              "hit_rate_5s_after_back": rate(t_back, t_back + 5)[0], "hit_rate_after_back_5s_on": rate(t_back + 5, a.seconds)[0],
              "per_second": per_second}
    print(json.dumps({k: v for k, v in report.items() if k != "per_second"}), flush=True)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["multiturn", "fault"])
    ap.add_argument("--kvcodec", default="build/kvcodec")
    ap.add_argument("--method", default="fp16", help="a second method whose Redis bytes are measured too")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--chunk", type=int, default=64, help="--prefix-chunk of the servers")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--target-tokens", type=int, default=1200)
    ap.add_argument("--message-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--conversation-chars", type=int, default=40000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--fault-prompts", type=int, default=24)
    ap.add_argument("--fault-lines", type=int, default=14)
    ap.add_argument("--no-fp16", action="store_true", help="multiturn: only --method's memory figures (no TTFT run)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is absent (scripts/install_deps.sh installs it)")
    common = ["--threads", str(a.threads), "--max-tokens-limit", str(max(16, a.max_tokens))]
    report = multiturn_run(a, common) if a.mode == "multiturn" else fault_run(a, common)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

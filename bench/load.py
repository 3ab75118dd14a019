#!/usr/bin/env python3
"""Load test of `kvcodec serve` (issue 6): N concurrent clients for a bounded
time on loopback, each looping over a seeded mix of requests:

  completion (short prompts sharing a prefix, so the prefix store hits,
  evicts and supersedes), streaming chat, /v1/kv/stats, /health and a
  deliberately invalid request (must get 400).

Passes when: every generation request got 200 or a documented 503 (queue
full: JSON error of type "overloaded" with Retry-After, which the clients
honour unless --no-backoff; the server answers no 429), every invalid one 400, every stats/health
200, no connection failed, the server is still alive and answers /health,
/v1/kv/stats stayed consistent at every poll (hits <= lookups, bytes <=
budget, queued <= max_queue, running in {0, 1}, counters never go down), and
at the end the server's counters equal what the clients saw (served = 200s,
rejected_queue_full = 503s, failed = cancelled = 0). Then SIGTERM must stop it
with exit status 0.

Only the Python standard library. Usage:
  bench/load.py --kvcodec build/kvcodec [--clients 16] [--seconds 60] [--max-queue 4] [--json out.json]
"""
import argparse, json, random, sys, threading, time

from kvserver import request, start, stop


PREFIX = "".join(f"def helper_{i}(value):\n    return value * {i} + {i * i}\n" for i in range(24))


def client(cid, port, deadline, out, lock, a_no_backoff=False):
    rnd = random.Random(1000 + cid)
    seen = {}
    problems = []
    while time.time() < deadline:
        kind = rnd.choices(["complete", "chat_stream", "stats", "health", "invalid"], [5, 3, 2, 1, 1])[0]
        hdr = {}
        if kind == "complete":
            prompt = PREFIX[: rnd.randrange(200, len(PREFIX))] + f"\nprint(helper_{rnd.randrange(24)}({cid}))\n"
            status, body = request(port, "/v1/completions", {"prompt": prompt, "max_tokens": rnd.randrange(1, 6), "temperature": 0},
                                   headers=hdr)
            ok = status in (200, 503)
        elif kind == "chat_stream":
            msgs = [{"role": "user", "content": PREFIX[: rnd.randrange(100, 600)]}]
            status, body = request(port, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "stream": True}, headers=hdr)
            ok = status in (200, 503) and (status != 200 or body.rstrip().endswith(b"data: [DONE]"))
        elif kind == "stats":
            status, body = request(port, "/v1/kv/stats")
            ok = status == 200
        elif kind == "health":
            status, body = request(port, "/health")
            ok = status == 200
        else:
            status, body = request(port, "/v1/completions", {"prompt": "x", "max_tokens": -1})
            ok = status == 400
        if status == 503 and kind in ("complete", "chat_stream"):
            # Documented overload answer: JSON error and Retry-After; a client
            # honours it (with jitter) instead of hammering the server.
            retry = hdr.get("Retry-After")
            ok = ok and retry is not None and b'"overloaded"' in body
            if not a_no_backoff and retry is not None:
                time.sleep(float(retry) * rnd.uniform(0.5, 1.0))
        key = f"{kind} {status}"
        seen[key] = seen.get(key, 0) + 1
        if not ok:
            problems.append(f"client {cid}: {kind} got {status}: {body[:200]!r}")
    with lock:
        for k, v in seen.items():
            out["counts"][k] = out["counts"].get(k, 0) + v
        out["problems"] += problems


def check_stats(s, prev, problems):
    ps, rq = s["prefix_store"], s["requests"]
    def bad(msg):
        problems.append(f"stats at uptime {s['uptime_s']:.1f}s: {msg}")
    if ps["hits"] > ps["lookups"]:
        bad(f"hits {ps['hits']} > lookups {ps['lookups']}")
    if ps["bytes"] > ps["budget_bytes"]:
        bad(f"store bytes {ps['bytes']} > budget {ps['budget_bytes']}")
    if ps["entries"] < 0 or (ps["entries"] == 0) != (ps["bytes"] == 0):
        bad(f"entries {ps['entries']} and bytes {ps['bytes']} disagree")
    if rq["queued"] > rq["max_queue"] or rq["running"] not in (0, 1):
        bad(f"queued {rq['queued']} / running {rq['running']}")
    if s["retained"]["total"]["fp16_bytes"] and not (s["tokens"]["retained"] > 0):
        bad("retained bytes without retained tokens")
    if prev:
        for path in (("prefix_store", "lookups"), ("prefix_store", "hits"), ("prefix_store", "stores"),
                     ("requests", "served"), ("requests", "rejected_queue_full"), ("tokens", "seen")):
            if s[path[0]][path[1]] < prev[path[0]][path[1]]:
                bad(f"{'.'.join(path)} went down: {prev[path[0]][path[1]]} -> {s[path[0]][path[1]]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvcodec", default="build/kvcodec")
    ap.add_argument("--method", default="fp16")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--max-queue", type=int, default=4, help="small, so that overload (503) happens")
    ap.add_argument("--store-bytes", type=int, default=4 << 20, help="small, so that eviction happens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-backoff", action="store_true", help="clients ignore Retry-After (hammer the server)")
    ap.add_argument("--json")
    a = ap.parse_args()
    args = ["--method", a.method, "--max-queue", str(a.max_queue), "--prefix-store-bytes", str(a.store_bytes),
            "--prefix-block", "16", "--threads", str(a.threads)] + sum((["--set", s] for s in a.set), [])
    p, port = start(a.kvcodec, args)
    out = {"counts": {}, "problems": []}
    lock = threading.Lock()
    polls = []
    t0 = time.time()
    deadline = t0 + a.seconds
    threads = [threading.Thread(target=client, args=(i, port, deadline, out, lock, a.no_backoff)) for i in range(a.clients)]
    for t in threads:
        t.start()
    prev = None
    while any(t.is_alive() for t in threads):
        status, body = request(port, "/v1/kv/stats", timeout=30)
        if status != 200:
            out["problems"].append(f"monitor: /v1/kv/stats got {status}")
        else:
            s = json.loads(body)
            check_stats(s, prev, out["problems"])
            polls.append({"t": time.time() - t0, "queued": s["requests"]["queued"], "rss": s["memory"]["rss_bytes"],
                          "store_bytes": s["prefix_store"]["bytes"]})
            prev = s
        time.sleep(0.5)
    for t in threads:
        t.join()
    elapsed = time.time() - t0
    alive = p.poll() is None
    status, body = request(port, "/health")
    final = json.loads(request(port, "/v1/kv/stats")[1]) if alive else None
    c = out["counts"]
    gen200 = c.get("complete 200", 0) + c.get("chat_stream 200", 0)
    gen503 = c.get("complete 503", 0) + c.get("chat_stream 503", 0)
    if not alive or status != 200:
        out["problems"].append(f"server not alive after the run (health {status})")
    if final:
        check_stats(final, prev, out["problems"])
        rq = final["requests"]
        if rq["served"] != gen200:
            out["problems"].append(f"server served {rq['served']} but clients got {gen200} generation 200s")
        if rq["rejected_queue_full"] != gen503:
            out["problems"].append(f"server rejected {rq['rejected_queue_full']} but clients got {gen503} 503s")
        if rq["failed"] or rq["cancelled"] or rq["queued"] or rq["running"]:
            out["problems"].append(f"after the run: failed {rq['failed']}, cancelled {rq['cancelled']}, "
                                   f"queued {rq['queued']}, running {rq['running']}")
    rc = stop(p)
    if rc != 0:
        out["problems"].append(f"SIGTERM: exit status {rc}")
    ps = final["prefix_store"] if final else {}
    report = {"clients": a.clients, "max_queue": a.max_queue, "backoff": not a.no_backoff, "seconds": elapsed, "counts": dict(sorted(c.items())),
              "requests": sum(c.values()), "requests_per_s": sum(c.values()) / elapsed,
              "generation_200": gen200, "generation_503": gen503, "stats_polls": len(polls),
              "max_queued_seen": max((x["queued"] for x in polls), default=0),
              "peak_rss_mib": (final["memory"]["peak_rss_bytes"] / 2**20) if final else None,
              "store": {k: ps.get(k) for k in ("entries", "bytes", "budget_bytes", "lookups", "hits", "stores",
                                               "evictions", "superseded")},
              "exit_status": rc, "problems": out["problems"][:50], "problem_count": len(out["problems"])}
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if not out["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())

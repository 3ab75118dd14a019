"""Helpers shared by the server benchmarks (load.py, multiturn.py): start
`kvcodec serve` on a free loopback port, send JSON requests, stop it."""
import json, re, subprocess, threading, urllib.error, urllib.request


def start(binary, args):
    """(process, port) of `binary serve --port 0 ARGS`, once it prints its ready line."""
    p = subprocess.Popen([binary, "serve", "--port", "0"] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in p.stdout:
        m = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
        if m:
            # Keep draining the log so the server never blocks on a full pipe.
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, int(m.group(1))
    raise SystemExit("server did not start: " + " ".join(args))


def stop(p, timeout=120):
    """SIGTERM, then the exit status; "hung" (after a SIGKILL) if it does not exit in time."""
    p.terminate()
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return "hung"


def request(port, path, body=None, timeout=120, headers=None):
    """(status, body bytes); status None when the connection itself failed.
    `headers`, a dict, receives the response headers."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if headers is not None:
                headers.update(r.headers)
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        if headers is not None:
            headers.update(e.headers)
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return None, str(e).encode()

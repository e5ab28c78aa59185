"""The remote cache tier (--remote-cache): a second node's first scan of a
graph another node compiled, against a cold compile of the same graph.

usage: remote.py BUILD_DIR OUT_JSON

A redis-server on a private Unix socket; per graph (the lorenz RK4 step and
the cumulative sum, T = 32), three daemons on fresh local caches that share
it and one Inductor cache:
  cold_s        node A's first scan: a local compile (then published)
  remote_s      node B's first scan: the blob fetched, verified, committed,
                loaded, run
  local_s       node B again after a restart: its local cache's hit
  blob_mib      the blob's size
  fetch_ms_per_mib  (remote_s - local_s) / blob_mib: what the tier adds per
                MiB over a local hit (GET, HMAC, the local commit)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import ROOT, Client, Daemon  # noqa: E402

import numpy as np  # noqa: E402

T = 32
GRAPHS = {
    "lorenz": ("lorenz.py", "rk4", lambda: ({k: np.full(64, 1.0) for k in "xyz"},
                                           {"forcing": np.full((T, 64), 0.01)})),
    "cumsum": ("cumsum.py", "body", lambda: (np.zeros(4096), np.ones((T, 4096)))),
}


def redis(tmp: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "redis.sock")
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", sock,
                             "--unixsocketperm", "700", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        if os.path.exists(sock):
            return proc, sock
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def first_scan(build: str, tmp: str, cache: str, args: tuple, graph: str) -> tuple[float, dict]:
    """A daemon on cache: the graph registered, its first scan timed; stats after."""
    body, entry, data = GRAPHS[graph]
    d = Daemon(build, cache, tmp, extra=args, sock=f"sock-{os.path.basename(cache)}")
    try:
        c = Client(d.sock)
        src = open(os.path.join(ROOT, "examples", "bodies", body)).read()
        r = c.call("register", name=f"remote.{graph}", body_source=src, body_file=body,
                   entry=entry, max_steps=128, max_elements=1 << 20, recompile_budget=4)
        assert "result" in r, r
        carry, xs = data()
        t0 = time.monotonic()
        r = c.call("scan", adapter=f"remote.{graph}", carry=carry, inputs=xs)
        took = time.monotonic() - t0
        assert "result" in r, r
        for _ in range(200):  # the publish comes after the reply
            stats = c.call("stats")["result"]
            if stats["remote"]["publishes"] or stats["remote"]["hits"]:
                break
            time.sleep(0.05)
        return took, stats["remote"]
    finally:
        d.stop()


def one_graph(build: str, tmp: str, args: tuple, graph: str) -> dict:
    a, b = (os.path.join(tmp, f"{graph}-{n}") for n in "ab")
    cold_s, sa = first_scan(build, tmp, a, args, graph)
    remote_s, sb = first_scan(build, tmp, b, args, graph)
    local_s, _ = first_scan(build, tmp, b, args, graph)
    assert sa["publishes"] == 1 and sb["hits"] == 1, (sa, sb)
    mib = sb["bytes_in"] / (1 << 20)
    return {"graph": graph, "T": T, "cold_s": cold_s, "remote_s": remote_s, "local_s": local_s,
            "blob_mib": mib, "fetch_ms_per_mib": 1000 * (remote_s - local_s) / mib}


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="tl-bench-remote-")
    proc, sock = redis(tmp)
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write("bench secret\n")
    os.chmod(secret, 0o600)
    args = ("--remote-cache", f"unix://{sock}", "--remote-secret-file", secret)
    try:
        rows = [one_graph(build, tmp, args, g) for g in GRAPHS]
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['graph']}: cold {r['cold_s']:.1f} s, remote hit {r['remote_s']:.2f} s, "
              f"local hit {r['local_s']:.2f} s, blob {r['blob_mib']:.2f} MiB, "
              f"{r['fetch_ms_per_mib']:.1f} ms/MiB")


if __name__ == "__main__":
    main()

"""Compile-strategy benchmark: unrolled loop vs torch's scan op vs chunks.

usage: strategy.py BUILD_DIR OUT_JSON [--only STRATEGY[:T]]

`chunk` runs at T = 128 only (below and at 16 steps it is the unrolled loop):
its compile is the 16-step graph's, its run eight runs of that graph.
--only measures one strategy (e.g. chunk, or unroll:128 for one T) and
writes just its rows.

Starts a daemon on a private, empty cache (so every compile is cold), and for
an elementwise recurrence (ema, carry [64]), a small matmul RNN (rnn_carry,
h [4, 32], W [32, 32], U [8, 32]), RK4 of the Lorenz system with a dict carry
(lorenz, x/y/z [16], forcing [T, 16]) and a GRU cell (gru_carry, h [4, 32],
three W [32, 32], three U [8, 32]) under both strategies and T in {1, 16, 128}:
warms the specialization with the compile op (recording the worker's compile
seconds), then runs 300 scans and reads the daemon's own run-time p50/p99 for
that adapter (engine time, no IPC).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from tlwire import Client  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def start_daemon(build: str, cache: str, sock: str, log: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [os.path.join(build, "torchloopd"), "--socket", sock, "--cache-dir", cache, "--no-probe",
         # each strategy compiled as asked (no quick tier in front of unroll)
         "--compile-timeout", "1800", "--quick-tier-steps", "0"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            c = Client(sock)
            if c.call("health")["result"]["ready"]:
                return proc
        except (OSError, EOFError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError("daemon did not start; see " + log)


def shapes(body: str, steps: int):
    rng = np.random.default_rng(0)
    if body == "ema":
        return rng.standard_normal(64), rng.standard_normal((steps, 64))
    if body == "lorenz":
        return ({k: rng.standard_normal(16) for k in ("x", "y", "z")},
                {"forcing": rng.standard_normal((steps, 16)) * 0.1})
    if body == "gru":
        h = rng.standard_normal((4, 32))
        ws = tuple(rng.standard_normal((32, 32)) * 0.2 for _ in range(3))
        us = tuple(rng.standard_normal((8, 32)) * 0.3 for _ in range(3))
        return (h, *ws, *us), rng.standard_normal((steps, 4, 8))
    h = rng.standard_normal((4, 32))
    w = rng.standard_normal((32, 32)) * 0.2
    u = rng.standard_normal((8, 32)) * 0.3
    return (h, w, u), rng.standard_normal((steps, 4, 8))


def spec(tree):
    if isinstance(tree, tuple):
        return {"k": "tuple", "c": [spec(t) for t in tree]}
    if isinstance(tree, dict):
        return {"k": "dict", "keys": list(tree), "c": [spec(t) for t in tree.values()]}
    return {"k": "T", "s": list(tree.shape)}


def fresh_daemon(build: str, prefix: str) -> tuple[subprocess.Popen, Client]:
    """A daemon on a new, empty cache (every compile cold) and a client of it."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    sock = os.path.join(tmp, "sock")
    proc = start_daemon(build, os.path.join(tmp, "cache"), sock, os.path.join(tmp, "log"))
    return proc, Client(sock)


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    proc, c = fresh_daemon(build, "tl-bench-")
    rows = []
    bodies = {"ema": ("examples/bodies/ema.py", "body"), "rnn": ("examples/bodies/rnn_carry.py", "cell"),
              "lorenz": ("examples/bodies/lorenz.py", "rk4"),
              "gru": ("examples/bodies/gru_carry.py", "cell")}
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    only_t = int(only.split(":")[1]) if only and ":" in only else None
    only = only.split(":")[0] if only else None
    plan = [("unroll", (1, 16, 128)), ("scan", (1, 16, 128)), ("chunk", (128,))]
    for body, (path, entry) in bodies.items():
        for strategy, all_steps in plan:
            if only and strategy != only:
                continue
            for steps in all_steps:
                if only_t and steps != only_t:
                    continue
                name = f"bench.{body}.{strategy}.{steps}"
                src = open(os.path.join(ROOT, path)).read()
                r = c.call("register", name=name, body_source=src, body_file=path, entry=entry,
                           strategy=strategy, max_steps=128, max_elements=1048576)
                assert "result" in r, r
                carry, xs = shapes(body, steps)
                t0 = time.monotonic()
                # the compile op takes shape trees, so this request is built by hand
                c.next_id += 1
                c.send_raw(msgpack.packb({"id": c.next_id, "op": "compile", "adapter": name,
                                          "dtype": "float64", "kind": "scan",
                                          "carry": spec(carry), "inputs": spec(xs)}))
                while True:
                    reply = c.recv()
                    if "event" not in reply:
                        break
                wall = time.monotonic() - t0
                if "error" in reply:
                    rows.append({"body": body, "strategy": strategy, "T": steps,
                                 "error": reply["error"]["code"] + ": " + reply["error"]["message"][:200]})
                    print(rows[-1], flush=True)
                    continue
                for _ in range(300):
                    res = c.call("scan", adapter=name, carry=carry, inputs=xs)
                    assert "result" in res, res
                d = c.call("describe", name=name)["result"]["counters"]
                rows.append({"body": body, "strategy": strategy, "T": steps,
                             "compile_s": reply["result"]["compile_seconds"], "wall_s": wall,
                             "phases": reply["result"].get("compile_phases", {}),
                             "run_p50_us": d["run_p50_us"], "run_p99_us": d["run_p99_us"]})
                print(rows[-1], flush=True)
    finish(proc, out, rows)


def finish(proc: subprocess.Popen, out: str, rows: list[dict]) -> None:
    """Stops the benchmark's daemon and writes its rows to out (JSON)."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

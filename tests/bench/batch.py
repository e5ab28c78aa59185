"""Symbolic-batch benchmark: compiles per 8 batch sizes, static vs dynamic.

usage: batch.py BUILD_DIR OUT_JSON

Starts a daemon on a private, empty cache (every compile cold). For two
bodies -- the tanh RNN with captured weights (examples/bodies/rnn.py, carry
(h [B, 8], None), x [T, B, 3]) and RK4 of the Lorenz system with a dict carry
(examples/bodies/lorenz.py, x/y/z [B], forcing [T, B]) -- at T = 16, it
registers the body twice, static (one graph per batch size) and with
dynamic = batch, and sends scans at 8 batch sizes to each: the compiles the
daemon counted and their seconds, then the round-trip p50 per batch size of
both, interleaved (same client, same IPC; the difference is the graph's).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from strategy import finish, fresh_daemon  # noqa: E402
from tlwire import Client  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STEPS = 16
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
ITERS = 300
BODIES = {"rnn": ("examples/bodies/rnn.py", "cell"), "lorenz": ("examples/bodies/lorenz.py", "rk4")}


def trees(body: str, batch: int):
    rng = np.random.default_rng(batch)
    if body == "lorenz":
        return ({k: rng.standard_normal(batch) for k in ("x", "y", "z")},
                {"forcing": rng.standard_normal((STEPS, batch)) * 0.1})
    return (rng.standard_normal((batch, 8)), None), rng.standard_normal((STEPS, batch, 3))


def round_trip_us(c: Client, name: str, carry, xs) -> float:
    t0 = time.perf_counter()
    r = c.call("scan", adapter=name, carry=carry, inputs=xs)
    assert "result" in r, r
    return (time.perf_counter() - t0) * 1e6


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    proc, c = fresh_daemon(build, "tl-batch-")
    rows = []
    for body, (path, entry) in BODIES.items():
        src = open(os.path.join(ROOT, path)).read()
        names = {}
        for dynamic in ("none", "batch"):
            name = names[dynamic] = f"bench.{body}.{dynamic}"
            r = c.call("register", name=name, body_source=src, body_file=path, entry=entry,
                       dynamic=dynamic, max_steps=STEPS, max_elements=65536,
                       recompile_budget=len(BATCHES))
            assert "result" in r, r
            t0 = time.monotonic()
            for batch in BATCHES:
                round_trip_us(c, name, *trees(body, batch))
            wall = time.monotonic() - t0
            counters = c.call("describe", name=name)["result"]["counters"]
            rows.append({"body": body, "dynamic": dynamic, "kind": "compiles",
                         "batch_sizes": len(BATCHES), "compiles": counters["compiles"],
                         "compile_s": counters["compile_seconds"], "first_pass_s": wall,
                         "graphs": counters["graphs"]})
            print(rows[-1], flush=True)
        for batch in BATCHES:
            carry, xs = trees(body, batch)
            times = {"none": [], "batch": []}
            for _ in range(ITERS):
                for dynamic in ("none", "batch"):
                    times[dynamic].append(round_trip_us(c, names[dynamic], carry, xs))
            rows.append({"body": body, "kind": "latency", "batch": batch,
                         "static_p50_us": float(np.median(times["none"])),
                         "dynamic_p50_us": float(np.median(times["batch"]))})
            print(rows[-1], flush=True)
    finish(proc, out, rows)


if __name__ == "__main__":
    main()

"""The solver's own path: `loop_adapter(...).scan` against torch.compile in process.

usage: pypath.py BUILD_DIR OUT_JSON [--quick] [--only warm|first] [--rows ema:4096:16:bwd,…]
                 [--daemon-env K=V,…]

Issue 30's table, measured the way a solver calls the package (plain torch
tensors, `adapter.scan(body, carry, inputs)`):
  (a)     the eager loop (tests/python/eager.py's scan)
  (b)     torch.compile(fullgraph=True, dynamic=False, backend="inductor") of
          that loop in process, a code object of its own (the reference
          adapter's way)
  (g)     torchloop.loop_adapter(max_steps=128, max_elements=1048576).scan
          with the same carry every call
  (g fb)  the same with the carry fed back from the previous reply, as a
          solver's loop does
  (g local) loop_adapter(..., run="local").scan: the daemon's compiled graph
          run in this process (torchloop/_local.py); (g) and (g vjp) are
          run="daemon" whatever $TORCHLOOP_RUN says.  Forward + backward
          rows measure it too, but a scan with gradients goes through the
          daemon today: there it is the daemon path under another adapter
Bodies: "ema", `c = 0.9 c + 0.1 tanh(x)` float64, carry [N], inputs [T, N];
"gru", a GRU-like cell over h [64, 32] with x [T, 64, 16], its weights
closure tensors (the captured path sends them as params).

Forward: p50 per call, each method in turn for 5 rounds (the median round's
p50 is reported, and every round).  Forward + backward: `f, ys = scan(...);
(f.sum() + ys.sum()).backward()` with carry and inputs requiring grad, (b),
(g) (the saved pair: the backward starts from what the forward kept) and
(g vjp) (`save=False`: the backward runs the VJP graph, the forward
again).  Every row first checks (g) against (b): results (and gradients,
(g vjp)'s too) within 1e-10, and (g local) against (g): torch.equal results
(gradients), else the row fails; so does a local adapter that falls back to the
daemon (its RuntimeWarning is an error here) or runs nothing locally.  One child process per row, against one daemon (the bench's
defaults: final graphs, no quick tier) on a private cache.

First calls: each example body (examples/bodies: cumsum, ema, lorenz.rk4,
rnn.tanh, with tier.py's trees) at T = 16 and 128, in a fresh process:
seconds of its first scan, (b) with a fresh Inductor cache of its own, (g)
against a fresh daemon with the defaults a user gets (the quick tier on),
without and with eager_first.  Inductor's FX graph cache is off on both
sides; the daemons share one Inductor directory whose precompiled headers a
first, unrelated compile built (as a long-running daemon has them).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
sys.path.insert(0, HERE)
from bench import Daemon, settle  # noqa: E402

FORWARD = [("ema", 4, 1), ("ema", 4, 128), ("ema", 4096, 1), ("ema", 4096, 16),
           ("ema", 4096, 128), ("ema", 65536, 16), ("ema", 1048576, 1), ("gru", 64, 32)]
BACKWARD = [("ema", 4096, 16), ("gru", 64, 64), ("ema", 4, 128)]
EXAMPLES = ("cumsum", "ema", "lorenz.rk4", "rnn.tanh")

# Shared by the children: the bodies and their trees.
COMMON = r"""
import json, os, statistics, sys, time, warnings
from types import FunctionType
import torch, torchloop, eager

def ema(c, x):
    c = 0.9 * c + 0.1 * torch.tanh(x)
    return c, c

def make_gru(seed):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(32, 32, generator=g, dtype=torch.float64) * 0.2 for _ in range(3)]
    u = [torch.randn(16, 32, generator=g, dtype=torch.float64) * 0.3 for _ in range(3)]
    def cell(h, x):  # a closure: its weights are captured tensors
        z = torch.sigmoid(x @ u[0] + h @ w[0])
        r = torch.sigmoid(x @ u[1] + h @ w[1])
        cand = torch.tanh(x @ u[2] + (r * h) @ w[2])
        h = (1.0 - z) * h + z * cand
        return h, h
    return cell

def trees(kind, n, steps):
    g = torch.Generator().manual_seed(3)
    if kind == "gru":
        return (torch.rand(n, 32, generator=g, dtype=torch.float64),
                torch.rand(steps, n, 16, generator=g, dtype=torch.float64))
    return (torch.rand(n, generator=g, dtype=torch.float64),
            torch.rand(steps, n, generator=g, dtype=torch.float64))

def reference():
    fn = FunctionType(eager.scan.__code__.replace(), eager.scan.__globals__)
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)
"""

# One row: argv sock kind n steps mode(fwd|bwd) rounds.  Prints JSON.
ROW = COMMON + r"""
sock, kind, n, steps, mode, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
body = ema if kind == "ema" else make_gru(11)
carry, xs = trees(kind, n, steps)
ref = reference()
ad = torchloop.loop_adapter(max_steps=128, max_elements=1 << 20, socket=sock, run="daemon")
# a local adapter that falls back to the daemon would time the daemon: an error here
warnings.filterwarnings("error", message="torchloop: run='local'")
local = torchloop.loop_adapter(max_steps=128, max_elements=1 << 20, socket=sock, run="local")
scans = {"a": eager.scan, "b": ref, "g": ad.scan, "g_local": local.scan}
if mode == "bwd":  # the backward that runs the VJP graph (the forward again)
    scans["g_vjp"] = torchloop.loop_adapter(max_steps=128, max_elements=1 << 20, socket=sock,
                                            save=False, run="daemon").scan

def ran_locally(calls):
    # how many of `calls` forward scans of (g local) ran in process: LocalGraph.run
    # counted for this pass only (the timed calls are not wrapped)
    from torchloop import _local
    inner, seen = _local.LocalGraph.run, [0]
    def counted(self, inputs):
        seen[0] += 1
        return inner(self, inputs)
    _local.LocalGraph.run = counted
    try:
        outs = [local.scan(body, carry, xs) for _ in range(calls)]
    finally:
        _local.LocalGraph.run = inner
    return seen[0], outs[-1]

def check_local():
    # (g local) against the daemon path (g): the same graph, bitwise
    if mode == "fwd":
        seen, got = ran_locally(1)
        want = ad.scan(body, carry, xs)
        if seen != 1:
            sys.exit(f"(g local) ran {seen} of 1 scans in process")
        pairs = zip(eager.leaves(got), eager.leaves(want))
    else:
        grads = []
        for s in (local.scan, ad.scan):
            c, x = carry.clone().requires_grad_(), xs.clone().requires_grad_()
            f, ys = s(body, c, x)
            (f.sum() + ys.sum()).backward()
            grads += [f.detach(), ys.detach(), c.grad, x.grad]
        pairs = zip(grads[:4], grads[4:])
    if not all(torch.equal(p, q) for p, q in pairs):
        sys.exit("(g local) differs from (g), the daemon path (torch.equal)")

def check():
    worst = 0.0
    if mode == "fwd":
        for x, y in zip(eager.leaves(ref(body, carry, xs)), eager.leaves(ad.scan(body, carry, xs))):
            worst = max(worst, (x - y).abs().max().item())
        return worst
    grads = []
    for s in (ref, ad.scan, scans["g_vjp"]):
        c, x = carry.clone().requires_grad_(), xs.clone().requires_grad_()
        f, ys = s(body, c, x)
        (f.sum() + ys.sum()).backward()
        grads.append((c.grad, x.grad))
    return max((p - q).abs().max().item() for g in grads[1:] for p, q in zip(grads[0], g))

def call(name):
    scan = scans[name]
    if mode == "fwd":
        return lambda: scan(body, carry, xs)
    c, x = carry.clone().requires_grad_(), xs.clone().requires_grad_()
    def once():
        c.grad = x.grad = None
        f, ys = scan(body, c, x)
        (f.sum() + ys.sum()).backward()
    return once

def fed_back():
    state = [carry]
    def once():
        state[0] = ad.scan(body, state[0], xs)[0]
    return once

fns = {k: call(k) for k in (("a", "b", "g", "g_local") if mode == "fwd"
                            else ("b", "g", "g_vjp", "g_local"))}
if mode == "fwd":
    fns["g_fb"] = fed_back()
from bench import settle  # the compiles' helper processes wound down

diff = check()
check_local()
settle()
per_call = {}
for k, fn in fns.items():  # warm-up (0.5 s each); its median call sets the count per round
    t_end, seen = time.perf_counter() + 0.5, []
    while time.perf_counter() < t_end:
        t0 = time.perf_counter(); fn(); seen.append(time.perf_counter() - t0)
    per_call[k] = statistics.median(seen)
stats0 = torchloop.Client(sock).stats()
runs0 = {a["name"]: a["runs"] for a in stats0["adapters"]}
p50s = {k: [] for k in fns}
for _ in range(rounds):
    for k, fn in fns.items():
        count = max(20, min(1000, int(0.3 / max(per_call[k], 1e-6))))
        ts = []
        for _ in range(count):
            t0 = time.perf_counter(); fn(); ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
        p50s[k].append(ts[len(ts) // 2])
# the graph's own run time in the daemon: the adapter that ran the most scans here
stats1 = torchloop.Client(sock).stats()
busiest = max(stats1["adapters"], key=lambda a: a["runs"] - runs0.get(a["name"], 0))
# runs of every core's team that waited for a core (the client's own OpenMP workers)
contended = stats1.get("contended_runs", 0) - stats0.get("contended_runs", 0)
# where the daemon ran this row's graphs: on its loop thread (inline), on the
# runner with every core's team, or on the pool with one thread
ran = {k: stats1.get(f"{k}_runs", 0) - stats0.get(f"{k}_runs", 0) for k in ("inline", "runner")}
ran["pool"] = sum(a["runs"] - runs0.get(a["name"], 0) for a in stats1["adapters"]) \
    - ran["inline"] - ran["runner"]

def breakdown():
    # (g)'s calls split: the package's Python around the C round trip
    # (Client._conn_call: codec, socket, wake-ups, the daemon's loop and run);
    # medians over one more set of calls
    client = ad.scan.__self__.client
    inner = client._conn_call
    spent = [0.0]
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0
    client._conn_call = timed
    fn, total, conn = fns["g"], [], []
    for _ in range(max(20, min(1000, int(0.3 / max(per_call["g"], 1e-6))))):
        spent[0] = 0.0
        t0 = time.perf_counter(); fn(); total.append((time.perf_counter() - t0) * 1e6)
        conn.append(spent[0] * 1e6)
    del client._conn_call
    return {"total_us": statistics.median(total), "conn_us": statistics.median(conn),
            "python_us": statistics.median(t - c for t, c in zip(total, conn))}

ran_local = ran_locally(20)[0] if mode == "fwd" else 0
if mode == "fwd" and ran_local != 20:  # after the timed calls: they ran in process too
    sys.exit(f"(g local) ran {ran_local} of 20 scans in process after the rounds")
print(json.dumps({"max_diff": diff, "p50_us": {k: statistics.median(v) for k, v in p50s.items()},
                  "rounds_us": p50s, "run_us": busiest["run_p50_us"] if mode == "fwd" else None,
                  "contended_runs": contended, "ran": ran, "breakdown": breakdown() if mode == "fwd" else None}))
"""

# One first call: argv sock(or "-") body steps variant(b|g|g_eager).  Prints JSON.
FIRST = COMMON + r"""
import importlib.util
sock, name, steps, variant = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
module, entry = {"cumsum": ("cumsum", "body"), "ema": ("ema", "body"),
                 "lorenz.rk4": ("lorenz", "rk4"), "rnn.tanh": ("rnn", "cell")}[name]
spec = importlib.util.spec_from_file_location(module, os.path.join(sys.argv[5], module + ".py"))
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
body = getattr(mod, entry)
g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
if name in ("cumsum", "ema"):
    carry, xs = r(64), r(steps, 64)
elif name == "lorenz.rk4":
    carry, xs = {k: r(16) for k in "xyz"}, {"forcing": r(steps, 16) * 0.1}
else:
    carry, xs = (r(4, 8), None), r(steps, 4, 3)
if variant == "b":
    scan = reference()
else:
    scan = torchloop.loop_adapter(max_steps=128, max_elements=65536, socket=sock,
                                  eager_first=variant == "g_eager").scan
t0 = time.perf_counter()
out = scan(body, carry, xs)
first = time.perf_counter() - t0
worst = max((p - q).abs().max().item() for p, q in zip(eager.leaves(out), eager.leaves(eager.scan(body, carry, xs))))
print(json.dumps({"first_s": first, "max_diff_vs_eager": worst}))
"""


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "python"), HERE]))
    env.update(extra or {})
    return env


def run_child(args: list[str], env: dict, timeout: int = 3600) -> dict:
    settle()
    proc = subprocess.run([PY, "-c", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_table(build: str, rounds: int, quick: bool, env: dict | None = None,
               rows_only: list[str] | None = None) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="tlbench-pypath.")
    d = Daemon(build, os.path.join(tmp, "cache"), tmp, env=dict(os.environ, **(env or {})))
    rows = []
    try:
        plan = [(r, "fwd") for r in FORWARD] + [(r, "bwd") for r in BACKWARD]
        if rows_only:  # "ema:4096:16:bwd", …
            plan = [p for p in plan if ":".join(map(str, (*p[0], p[1]))) in rows_only]
        for (kind, n, steps), mode in plan[:3] if quick else plan:
            row = {"body": kind, "N": n, "T": steps, "mode": mode,
                   **run_child([ROW, d.sock, kind, str(n), str(steps), mode, str(rounds)],
                               child_env())}
            rows.append(row)
            print(f"pypath: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def first_calls(build: str, quick: bool) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="tlbench-pyfirst.")
    nocache = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    daemon_env = child_env({**nocache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor")})
    bodies = os.path.join(ROOT, "examples", "bodies")
    quick_tier = ("--quick-tier-steps", "32")  # the daemon's default, after Daemon's 0

    def daemon_first(name: str, steps: int, variant: str) -> dict:
        sub = tempfile.mkdtemp(dir=tmp)
        d = Daemon(build, os.path.join(sub, "cache"), sub, extra=quick_tier, env=daemon_env)
        try:
            return run_child([FIRST, d.sock, name, str(steps), variant, bodies], daemon_env)
        finally:
            d.stop()

    rows = []
    try:
        # an unrelated first compile builds the precompiled headers the daemons share
        d = Daemon(build, os.path.join(tmp, "warm"), tmp, extra=quick_tier, env=daemon_env)
        run_child([ROW, d.sock, "ema", str(3 + random.randrange(50)), "2", "fwd", "1"],
                  daemon_env)
        d.stop()
        for steps in (16,) if quick else (16, 128):
            for name in EXAMPLES[:1] if quick else EXAMPLES:
                own = child_env({**nocache, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp)})
                row = {"body": name, "T": steps,
                       "b": run_child([FIRST, "-", name, str(steps), "b", bodies], own),
                       "g": daemon_first(name, steps, "g"),
                       "g_eager": daemon_first(name, steps, "g_eager")}
                rows.append(row)
                print(f"pypath first: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    denv = dict(kv.split("=", 1) for kv in sys.argv[sys.argv.index("--daemon-env") + 1].split(",")) \
        if "--daemon-env" in sys.argv else None
    rows = sys.argv[sys.argv.index("--rows") + 1].split(",") if "--rows" in sys.argv else None
    out = {"warm": warm_table(build, 1 if quick else 5, quick, denv, rows) if only != "first" else [],
           "first": first_calls(build, quick) if only != "warm" else []}
    out["rounds"] = 1 if quick else 5
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

"""The solver's path under load: four solver processes on the 2 cores at once.

usage: loaded.py BUILD_DIR OUT_JSON [--seconds S] [--procs P] [--n N] [--steps T]
                 [--methods b,daemon,local]

Issue 55's loaded row.  P solver processes (default 4), each with a captured
body of its own (pypath.py's ema with a coefficient of its own,
`c = a_k c + (1 - a_k) tanh(x)`, a_k = 0.9 - 0.02 k, a float the capture
bakes into the graph: one graph per process), run warm scans of carry [N]
(default 4096), inputs [T, N] (default 16), float64, the same carry every
call, for S seconds (default 10), all at once, for each of:
  b       torch.compile(fullgraph=True, dynamic=False) of the eager loop in
          process (pypath.py's (b), the reference adapter's way)
  daemon  loop_adapter(max_steps=128, max_elements=1048576, run="daemon").scan
  local   the same with run="local": the daemon's compiled graph in the
          solver's process (torchloop/_local.py)
Each process compiles (or loads) its graph, checks its result (b and daemon
against the eager loop within 1e-10; local against a run="daemon" adapter of
the same body, torch.equal, and it must run in process, before the window
and after it: a fallback's RuntimeWarning is an error), warms up for 0.5 s, says so on its stdout and
waits on its stdin: the parent waits for every process's line, lets the
machine settle (the compiles' helper processes), and writes the start to all
of them at once.  Threads are what a user gets (torch's OpenMP team per
process, the daemon's defaults).  Reported per method: per-call p50/p99 over
all the processes' calls, each process's own, and total scans/s (all calls
over the window, from the start to the last call's end).  One daemon (the
bench's defaults: final graphs, no quick tier) on a private cache serves the
daemon and local methods.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import Daemon, settle  # noqa: E402
from pypath import COMMON, PY, child_env  # noqa: E402

METHODS = ("b", "daemon", "local")

# One solver process: argv sock method k n steps samples_path.  Prints "ready",
# reads "start_monotonic end_monotonic", then prints JSON.
SOLVER = COMMON + r"""
import array, warnings
sock, method, k, n, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
a = 0.9 - 0.02 * k

def body(c, x):  # a closure of its own: the coefficient is this process's
    c = a * c + (1.0 - a) * torch.tanh(x)
    return c, c

carry, xs = trees("ema", n, steps)
warnings.filterwarnings("error", message="torchloop: run='local'")  # a fallback fails
bounds = dict(max_steps=128, max_elements=1 << 20, socket=sock)
if method == "b":
    scan = reference()
else:
    ad = torchloop.loop_adapter(**bounds, run=method)
    scan = ad.scan
got = scan(body, carry, xs)
want = eager.scan(body, carry, xs)
if method == "local":
    want = torchloop.loop_adapter(**bounds, run="daemon").scan(body, carry, xs)
    same = all(torch.equal(p, q) for p, q in zip(eager.leaves(got), eager.leaves(want)))
else:
    same = all((p - q).abs().max().item() <= 1e-10
               for p, q in zip(eager.leaves(got), eager.leaves(want)))
if not same:
    sys.exit(f"{method} k={k}: the result differs from the reference")

def ran_locally(calls):
    # how many of `calls` scans ran in process: LocalGraph.run counted for this
    # pass only (the timed calls are not wrapped)
    from torchloop import _local
    inner, seen = _local.LocalGraph.run, [0]
    def counted(self, inputs):
        seen[0] += 1
        return inner(self, inputs)
    _local.LocalGraph.run = counted
    try:
        for _ in range(calls):
            scan(body, carry, xs)
    finally:
        _local.LocalGraph.run = inner
    return seen[0]

if method == "local" and ran_locally(1) != 1:
    sys.exit(f"local k={k}: a warm scan did not run in process")

t_end = time.perf_counter() + 0.5
while time.perf_counter() < t_end:
    scan(body, carry, xs)
print("ready", flush=True)
start, end = map(float, sys.stdin.readline().split())
ts = array.array("d")
while True:
    t0 = time.monotonic()
    if t0 >= end:
        break
    scan(body, carry, xs)
    ts.append(time.monotonic() - t0)
last = time.monotonic()
if method == "local" and ran_locally(20) != 20:  # after the window: those ran here too
    sys.exit(f"local k={k}: scans after the window did not all run in process")
with open(out, "wb") as f:
    ts.tofile(f)
s = sorted(ts)
print(json.dumps({"k": k, "calls": len(ts), "last": last, "p50_us": s[len(s) // 2] * 1e6,
                  "p99_us": s[int(len(s) * 0.99)] * 1e6, "load": os.getloadavg()}))
"""


def _pct(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(len(sorted_s) * q))] * 1e6


def _fail(procs: list[subprocess.Popen], errs: list[str], why: str) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    tails = "\n".join(open(e).read()[-1500:] for e in errs)
    raise RuntimeError(f"loaded: {why}\n{tails}")


def method_row(sock: str, method: str, procs: int, n: int, steps: int, seconds: float,
               tmp: str) -> dict:
    """P solver processes of one method, started together; their pooled
    per-call percentiles and total scans/s."""
    settle()
    env = child_env({"PYTHONUNBUFFERED": "1"})
    samples = [os.path.join(tmp, f"{method}.{k}.bin") for k in range(procs)]
    errs = [os.path.join(tmp, f"{method}.{k}.err") for k in range(procs)]
    ps = [subprocess.Popen([PY, "-c", SOLVER, sock, method, str(k), str(n), str(steps),
                            samples[k]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=open(errs[k], "w"), text=True, env=env)
          for k in range(procs)]
    t0 = time.monotonic()
    for p in ps:  # the barrier: every process compiled, checked and warm
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            _fail(ps, errs, f"a {method} process did not get ready")
    ready_s = time.monotonic() - t0
    settle(20)
    load = os.getloadavg()
    start = time.monotonic()
    for p in ps:  # all at once: the line is in every pipe before anyone reads
        assert p.stdin is not None
        p.stdin.write(f"{start} {start + seconds}\n")
        p.stdin.flush()
    outs = []
    for p in ps:
        assert p.stdout is not None
        line = p.stdout.read().strip().splitlines()
        if p.wait() != 0 or not line:
            _fail(ps, errs, f"a {method} process failed")
        outs.append(json.loads(line[-1]))
    pooled = array.array("d")
    for path in samples:
        with open(path, "rb") as f:
            pooled.frombytes(f.read())
    s = sorted(pooled)
    window = max(o["last"] for o in outs) - start
    return {"method": method, "p50_us": _pct(s, 0.5), "p99_us": _pct(s, 0.99),
            "calls": len(s), "scans_per_s": len(s) / window, "window_s": window,
            "ready_s": ready_s, "load_at_start": load,
            "procs": [{k: o[k] for k in ("k", "calls", "p50_us", "p99_us")} for o in outs]}


def _arg(name: str, default: float) -> float:
    return float(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    seconds, procs = _arg("--seconds", 10.0), int(_arg("--procs", 4))
    n, steps = int(_arg("--n", 4096)), int(_arg("--steps", 16))
    tmp = tempfile.mkdtemp(prefix="tlbench-loaded.")
    os.chmod(tmp, 0o755)
    d = Daemon(build, os.path.join(tmp, "cache"), tmp)
    rows = []
    try:
        methods = sys.argv[sys.argv.index("--methods") + 1].split(",") \
            if "--methods" in sys.argv else METHODS
        for method in methods:
            row = method_row(d.sock, method, procs, n, steps, seconds, tmp)
            rows.append(row)
            print(f"loaded: {json.dumps(row)}", file=sys.stderr, flush=True)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    with open(out_path, "w") as f:
        json.dump({"seconds": seconds, "procs": procs, "N": n, "T": steps,
                   "cpus": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

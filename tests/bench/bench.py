"""`make bench`: torchloopd side by side with in-process compile and eager.

usage: bench.py BUILD_DIR OUT_DIR [--quick]

Measures, in one run on this machine (a cumulative sum, carry [N] float64,
inputs [T, N], for N in {4, 4096, 1048576} and T in {1, 16, 128}; a leaf's
elements are bounded by max_elements = 1048576, so N = 1048576 runs T = 1
only):
  (a) an eager PyTorch loop in Python
  (b) torch.compile(fullgraph=True, dynamic=False, backend="inductor") of the
      same loop, called from Python (the reference adapter's way)
  (c) the daemon's AOTI artifact run in-process from C (the floor, no IPC)
  (d) the daemon through libtorchloop from C
  (e) the daemon through the CLI, a process per call
then throughput of (d) with 1..32 client processes, cold compile and warm
start against (b) in fresh processes, daemon RSS, and payload bandwidth.
Writes OUT_DIR/bench.json and PNG plots; docs/performance.md quotes them.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
from tlwire import Client  # noqa: E402

MAX_ELEMENTS = 1048576
SIZES = (4, 4096, 1048576)
STEPS = (1, 16, 128)

INPROC = r"""
import json, sys, time, torch
n, steps, iters, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def body(c, x):
    c = c + x
    return c, c
def loop(c, xs):
    ys = []
    for t in range(xs.shape[0]):
        c, y = body(c, xs[t])
        ys.append(y)
    return c, torch.stack(ys)
fn = loop if mode == "eager" else torch.compile(loop, fullgraph=True, dynamic=False, backend="inductor")
c = torch.arange(n, dtype=torch.float64) * 0.01
xs = torch.ones(steps, n, dtype=torch.float64)
t0 = time.perf_counter(); fn(c, xs); first = time.perf_counter() - t0
for _ in range(20): fn(c, xs)
ts = []
for _ in range(iters):
    t0 = time.perf_counter(); fn(c, xs); ts.append((time.perf_counter() - t0) * 1e6)
ts.sort()
print(json.dumps({"first_s": first, "p50_us": ts[len(ts) // 2], "p99_us": ts[int(len(ts) * 0.99)]}))
"""


def run_json(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Daemon:
    def __init__(self, build: str, cache: str, tmp: str) -> None:
        self.sock = os.path.join(tmp, "sock")
        self.proc = subprocess.Popen(
            [os.path.join(build, "torchloopd"), "--socket", self.sock, "--cache-dir", cache,
             "--no-probe", "--compile-timeout", "3600", "--log-level", "warn"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "daemon.log"), "a"))
        t0 = time.monotonic()
        while True:
            try:
                if Client(self.sock).call("health")["result"]["ready"]:
                    break
            except (OSError, EOFError):
                pass
            if time.monotonic() - t0 > 300:
                raise RuntimeError("daemon did not start")
            time.sleep(0.05)
        self.ready_s = time.monotonic() - t0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def register(c: Client, name: str) -> None:
    src = open(os.path.join(ROOT, "examples", "bodies", "cumsum.py")).read()
    r = c.call("register", name=name, body_source=src, body_file="cumsum.py", entry="body",
               max_steps=128, max_elements=MAX_ELEMENTS, recompile_budget=16)
    assert "result" in r, r


def timed_scan(c: Client, adapter: str, n: int, steps: int) -> float:
    t0 = time.monotonic()
    r = c.call("scan", adapter=adapter, carry=np.zeros(n), inputs=np.ones((steps, n)))
    assert "result" in r, r
    return time.monotonic() - t0


def configs(quick: bool):
    for n in SIZES:
        for steps in STEPS:
            if n * steps > MAX_ELEMENTS:
                continue  # clipped by max_elements
            if quick and (n > 4096 or steps > 16):
                continue
            yield n, steps


def latency(build: str, d: Daemon, cache: str, tmp: str, quick: bool) -> list[dict]:
    c = Client(d.sock)
    register(c, "bench.cumsum")
    rows = []
    py = os.path.join(ROOT, ".venv", "bin", "python")
    bench_c = os.path.join(build, "bench_c")
    cli = os.path.join(build, "torchloop")
    for n, steps in configs(quick):
        iters = 1000 if n <= 4096 else 200
        compile_s = timed_scan(c, "bench.cumsum", n, steps)
        so = newest_artifact(cache)
        row = {"N": n, "T": steps, "iters": iters, "daemon_first_scan_s": compile_s}
        row["a_eager"] = run_json([py, "-c", INPROC, str(n), str(steps), str(iters), "eager"])
        row["b_compile"] = run_json([py, "-c", INPROC, str(n), str(steps), str(iters), "compile"])
        row["c_inproc"] = run_json([bench_c, "inproc", so, str(n), str(steps), str(iters)])
        row["d_daemon"] = run_json([bench_c, "daemon", d.sock, "bench.cumsum", str(n), str(steps), str(iters)])
        row["e_cli"] = cli_latency(cli, d.sock, n, steps, 1000 if n <= 4096 else 100, tmp)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def newest_artifact(cache: str) -> str:
    return max(glob.glob(os.path.join(cache, "objects", "*.so")), key=os.path.getmtime)


def cli_latency(cli: str, sock: str, n: int, steps: int, iters: int, tmp: str) -> dict:
    np.save(os.path.join(tmp, "c.npy"), np.zeros(n))
    np.save(os.path.join(tmp, "x.npy"), np.ones((steps, n)))
    cmd = [cli, "--socket", sock, "scan", "bench.cumsum", "--carry", os.path.join(tmp, "c.npy"),
           "--inputs", os.path.join(tmp, "x.npy"), "--out", os.path.join(tmp, "out")]
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return {"p50_us": ts[len(ts) // 2], "p99_us": ts[int(len(ts) * 0.99)]}


def throughput(build: str, d: Daemon) -> list[dict]:
    rows = []
    for procs in (1, 2, 4, 8, 32):
        rows.append(run_json([os.path.join(build, "bench_c"), "clients", d.sock, "bench.cumsum",
                              "4", "16", str(procs), str(max(200, 4000 // procs))]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def starts(build: str, tmp: str) -> dict:
    """Cold compile and warm start: the daemon against (b) in fresh processes."""
    py = os.path.join(ROOT, ".venv", "bin", "python")
    out: dict = {}
    cache = os.path.join(tmp, "cold-cache")
    d = Daemon(build, cache, os.path.join(tmp))
    c = Client(d.sock)
    register(c, "bench.cold")
    out["daemon_cold_first_scan_s"] = timed_scan(c, "bench.cold", 4096, 16)
    rss_idle = rss_kb(d.proc.pid)
    d.stop()
    t0 = time.monotonic()
    d = Daemon(build, cache, os.path.join(tmp))
    c = Client(d.sock)
    register(c, "bench.cold")
    out["daemon_restart_to_ready_s"] = time.monotonic() - t0
    out["daemon_warm_first_scan_s"] = timed_scan(c, "bench.cold", 4096, 16)
    d.stop()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor-cold"))
    t0 = time.monotonic()
    r = run_json([py, "-c", INPROC, "4096", "16", "10", "compile"], env=env)
    out["b_cold_process_s"] = time.monotonic() - t0
    out["b_cold_first_call_s"] = r["first_s"]
    t0 = time.monotonic()
    r = run_json([py, "-c", INPROC, "4096", "16", "10", "compile"], env=env)
    out["b_warm_process_s"] = time.monotonic() - t0
    out["b_warm_first_call_s"] = r["first_s"]
    out["rss_idle_kb_after_one_graph"] = rss_idle
    return out


def memory(build: str, tmp: str, cache: str) -> dict:
    d = Daemon(build, cache, tmp)
    idle = rss_kb(d.proc.pid)
    c = Client(d.sock)
    register(c, "bench.cumsum")
    loaded = []
    for n, steps in ((4, 1), (4, 16), (4096, 1), (4096, 16)):
        timed_scan(c, "bench.cumsum", n, steps)
        loaded.append(rss_kb(d.proc.pid))
    d.stop()
    return {"rss_idle_kb": idle, "rss_after_graphs_kb": loaded,
            "per_graph_kb": (loaded[-1] - loaded[0]) / 3}


def plots(out_dir: str, rows: list[dict], thr: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, n in zip(axes, (4, 4096)):
        sub = [r for r in rows if r["N"] == n]
        steps = [r["T"] for r in sub]
        for key, label in (("a_eager", "(a) eager"), ("b_compile", "(b) torch.compile in-process"),
                           ("c_inproc", "(c) AOTI in-process, C"), ("d_daemon", "(d) daemon, libtorchloop"),
                           ("e_cli", "(e) daemon, CLI per call")):
            ax.plot(steps, [r[key]["p50_us"] for r in sub], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (steps)")
        ax.set_ylabel("p50 latency per scan (µs)")
        ax.set_title(f"cumulative sum, N = {n} float64 per step")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "latency.png"), dpi=110)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([t["procs"] for t in thr], [t["scans_per_s"] for t in thr], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent client processes")
    ax.set_ylabel("scans / s (N=4, T=16)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "throughput.png"), dpi=110)


def main() -> None:
    build, out_dir = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tl-bench-")
    cache = os.path.join(tmp, "cache")
    result: dict = {"machine": {"nproc": os.cpu_count(), "uname": " ".join(os.uname())}}
    d = Daemon(build, cache, tmp)
    result["latency"] = latency(build, d, cache, tmp, quick)
    result["throughput"] = throughput(build, d)
    mb = 1048576 * 8
    big = [r for r in result["latency"] if r["N"] * r["T"] == 1048576]
    if big:
        r = big[0]
        moved = (r["N"] + r["N"] * r["T"]) * 8 * 2  # request carry + inputs, reply carry + outputs
        result["payload"] = {"bytes_each_way": moved / 2, "d_p50_us": r["d_daemon"]["p50_us"],
                             "c_p50_us": r["c_inproc"]["p50_us"],
                             "memcpy": run_json([os.path.join(build, "bench_c"), "memcpy", str(mb), "200"])}
    d.stop()
    result["memory"] = memory(build, tmp, cache)
    result["starts"] = starts(build, tmp)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    plots(out_dir, result["latency"], result["throughput"])
    print("wrote", os.path.join(out_dir, "bench.json"))


if __name__ == "__main__":
    main()

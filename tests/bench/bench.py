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
  (f) the daemon through libtorchloop with shared memory, inputs allocated in
      the connection's region (tl_shm_alloc), results written there
  (g) the daemon through the `torchloop` Python client, defaults (tensors of
      128 KiB and more through shared memory, copied in per call)
then the shared-memory threshold (inline against shared memory per leaf
size, C and Python), throughput of (d) with 1..32 client processes, cold compile and warm
start against (b) in fresh processes, daemon RSS, and payload bandwidth.
It also measures where a small scan's time goes (a socketpair round trip, a
health round trip, the daemon without inline runs, its CPU and syscalls per
scan, and a callgrind profile of the loop thread).  Writes OUT_DIR/bench.json
and PNG plots; tests/bench/report.py turns them into docs/performance.md.
"""

from __future__ import annotations

import getpass
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import statistics
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
from tlwire import Client  # noqa: E402

sys.path.insert(0, HERE)
import pyclient  # noqa: E402

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


PYCLIENT = pyclient.SCANS  # argv: sock adapter N T iters mode


# Leaf sizes (float64 elements, T = 1) of the threshold sweep: 512 B to 512 KiB.
THRESHOLD_N = (64, 512, 1024, 2048, 4096, 8192, 16384, 65536)


def cpu_busy(interval: float = 0.5) -> float:
    """Fraction of all CPUs busy over interval, from /proc/stat."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = sample()
    time.sleep(interval)
    t1, i1 = sample()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def settle(limit_s: float = 60) -> None:
    """Waits until the machine is idle (under 10 % busy): a compile, or a Python process
    that just exited, leaves Inductor's compile subprocesses winding down, and on 2 cores
    that shows up in the next latency measured."""
    t0 = time.monotonic()
    while cpu_busy() > 0.10 and time.monotonic() - t0 < limit_s:
        pass


def p50_us(fn, iters: int) -> float:
    """The median of iters calls of fn, in microseconds."""
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000


def run_json(cmd: list[str], env: dict | None = None, timeout: int = 3600) -> dict:
    settle()
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
    def __init__(self, build: str, cache: str, tmp: str, extra: tuple = (), prefix: tuple = (),
                 sock: str = "sock", env: dict | None = None) -> None:
        self.sock = os.path.join(tmp, sock)
        # Inductor's precompiled headers as a long-running daemon has them
        # (built once, kept): every bench daemon shares torch's default place
        # rather than building them again in its fresh cache's inductor/
        env = dict(env if env is not None else os.environ)
        env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                       os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
        self.proc = subprocess.Popen(
            [*prefix, os.path.join(build, "torchloopd"), "--socket", self.sock, "--cache-dir",
             cache, "--no-probe", "--compile-timeout", "3600", "--log-level", "warn",
             # the final graphs are measured: no scan-op graph serving while they compile
             "--quick-tier-steps", "0", *extra],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "daemon.log"), "a"),
            env=env)
        t0 = time.monotonic()
        while True:
            try:
                if Client(self.sock).call("health")["result"]["ready"]:
                    break
            except (OSError, EOFError):
                pass
            if time.monotonic() - t0 > 600:
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
        row["f_shm"] = run_json([bench_c, "daemon", d.sock, "bench.cumsum", str(n), str(steps),
                                 str(iters), "inplace"])
        row["g_python"] = run_json([py, "-c", PYCLIENT, d.sock, "bench.cumsum", str(n), str(steps),
                                    str(iters), "default"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def threshold(build: str, d: Daemon, quick: bool) -> list[dict]:
    """Inline against shared memory per leaf size (carry [N], inputs [1, N])."""
    c = Client(d.sock)
    register(c, "bench.thresh")
    py = os.path.join(ROOT, ".venv", "bin", "python")
    bench_c = os.path.join(build, "bench_c")
    rows = []
    for n in THRESHOLD_N[:4] if quick else THRESHOLD_N:
        timed_scan(c, "bench.thresh", n, 1)
        row = {"N": n, "leaf_bytes": n * 8}
        for mode in ("inline", "staged"):
            row["c_" + mode] = run_json([bench_c, "daemon", d.sock, "bench.thresh", str(n), "1",
                                         "2000", mode])
        for mode in ("inline", "shm"):
            row["py_" + mode] = run_json([py, "-c", PYCLIENT, d.sock, "bench.thresh", str(n), "1",
                                          "2000", mode])
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
    settle()
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
                              "4", "16", str(procs), str(max(500, 30000 // procs))]))
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


def bench_c(build: str, *args) -> dict:
    return run_json([os.path.join(build, "bench_c"), *map(str, args)])


def cpu_ticks(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])  # utime, stime (clock ticks)


def cpu_per_scan(build: str, d: Daemon, n: int, steps: int, iters: int) -> dict:
    """The daemon's user and system CPU per scan, from /proc/PID/stat."""
    hz = os.sysconf("SC_CLK_TCK")
    u0, s0 = cpu_ticks(d.proc.pid)
    bench_c(build, "daemon", d.sock, "bench.cumsum", n, steps, iters)
    u1, s1 = cpu_ticks(d.proc.pid)
    scans = iters + 20
    return {"N": n, "T": steps, "scans": scans, "user_us": (u1 - u0) / hz / scans * 1e6,
            "sys_us": (s1 - s0) / hz / scans * 1e6}


def syscalls_per_scan(build: str, d: Daemon, tmp: str, iters: int = 2000) -> dict:
    """strace -c on the daemon while one client scans (N=4, T=1): calls per scan."""
    out = os.path.join(tmp, "strace.txt")
    st = subprocess.Popen(["strace", "-f", "-c", "-o", out, "-p", str(d.proc.pid)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    bench_c(build, "daemon", d.sock, "bench.cumsum", 4, 1, iters)
    st.send_signal(signal.SIGINT)
    st.wait(timeout=60)
    calls = {}
    with open(out) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                calls[parts[-1]] = int(parts[3]) / (iters + 20)
    return calls


PROFILE_FUNCS = ("on_read", "ops_dispatch", "msg_parse", "op_scan_decode", "op_scan_validate",
                 "graphs_acquire", "signature_of", "engine_run", "conn_send", "after_run")


def callgrind_profile(build: str, cache: str, tmp: str, iters: int = 2000) -> dict:
    """Instructions per scan on the loop thread (callgrind, collecting inside on_read).
    Under valgrind every graph is slow, so --inline-run-us is raised to keep the runs on
    the loop thread, where they are in production, and in the profile.  valgrind cannot
    execute AVX-512, so the graph is compiled for plain x86-64 (--target-isa baseline,
    as scripts/valgrind-daemon.sh does) and libtorch's kernels are held to the default
    ISA."""
    out = os.path.join(tmp, "callgrind.out")
    d = Daemon(build, cache, tmp, sock="cg.sock",
               extra=("--inline-run-us", "100000", "--target-isa", "baseline"),
               prefix=("valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                       "--toggle-collect=on_read"),
               env=dict(os.environ, ATEN_CPU_CAPABILITY="default"))
    c = Client(d.sock)
    register(c, "bench.cumsum")
    bench_c(build, "daemon", d.sock, "bench.cumsum", 4, 1, iters)
    d.stop()
    scans = iters + 20
    incl = subprocess.run(["callgrind_annotate", "--inclusive=yes", out], capture_output=True,
                          text=True).stdout
    excl = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True).stdout
    total = 0
    funcs: dict = {}
    for line in incl.splitlines():
        parts = line.split()
        if not parts or not parts[0].replace(",", "").isdigit():
            continue
        ir = int(parts[0].replace(",", ""))
        if "PROGRAM TOTALS" in line:
            total = ir
        for fn in PROFILE_FUNCS:
            if line.rstrip().endswith(":" + fn) or f":{fn} [" in line:
                funcs[fn] = max(funcs.get(fn, 0), ir / scans)
    top, in_table = [], False
    row = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$")
    for line in excl.splitlines():  # the function table only, not the annotated sources
        if line.rstrip().endswith("file:function"):
            in_table = True
            continue
        if in_table and not line.strip() and top:
            break
        m = row.match(line) if in_table else None
        if m:
            parts = [m.group(1), "", m.group(2)]
            name = parts[2].split(" [")[0]
            head, _, rest = name.partition(":")
            if rest and ("/" in head or head == "???" or head.endswith((".c", ".h", ".S"))):
                name = rest  # drop "file:" but keep C++'s "ns::f"
            name = name if len(name) <= 60 else name[:57] + "..."
            top.append({"function": name, "ir_per_scan": int(parts[0].replace(",", "")) / scans})
    return {"scans": scans, "ir_per_scan": total / scans, "inclusive": funcs, "top_self": top[:15]}


def floors(build: str, d: Daemon, cache: str, tmp: str, quick: bool) -> dict:
    """Where the time of a small scan goes: the kernel's and the protocol's floors, the
    thread-pool hand-off, the daemon's CPU and syscalls per scan."""
    out = {"sockpair": bench_c(build, "sockpair", 228, 5000),
           "sockpair_poll": bench_c(build, "sockpair", 228, 20000, "poll"),
           "sockpair_runner": bench_c(build, "sockpair", 228, 5000, "runner"),
           "sockpair_runner_poll": bench_c(build, "sockpair", 228, 20000, "poll", "runner"),
           "ping": bench_c(build, "ping", d.sock, 5000),
           "d_small": bench_c(build, "daemon", d.sock, "bench.cumsum", 4, 1, 5000)}
    pool = Daemon(build, cache, tmp, extra=("--inline-run-us", "0"), sock="pool.sock")
    register(Client(pool.sock), "bench.cumsum")
    out["d_small_pool_only"] = bench_c(build, "daemon", pool.sock, "bench.cumsum", 4, 1, 5000)
    pool.stop()
    out["cpu_small"] = cpu_per_scan(build, d, 4, 1, 5000)
    if not quick:  # the N = 1M graph exists only after a full latency run
        out["cpu_large"] = cpu_per_scan(build, d, MAX_ELEMENTS, 1, 100)
    try:
        out["syscalls"] = syscalls_per_scan(build, d, tmp)
    except (OSError, subprocess.SubprocessError) as e:
        out["syscalls_error"] = str(e)
    return out


def machine() -> dict:
    def cmd(*a: str) -> str:
        try:
            return subprocess.run(a, capture_output=True, text=True).stdout.strip()
        except OSError:
            return "?"

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "cpu": cpu, "nproc": os.cpu_count(),
            "mem_gib": round(mem_kb / 1048576, 1), "kernel": os.uname().release,
            "debian": open("/etc/debian_version").read().strip(),
            "torch": torch.__version__, "python": sys.version.split()[0],
            "gcc": cmd("gcc", "-dumpfullversion"),
            "libuv": cmd("pkg-config", "--modversion", "libuv"),
            "msgpack": cmd("sh", "-c", "pkg-config --modversion msgpack-c || pkg-config --modversion msgpack"),
            "loadavg_start": open("/proc/loadavg").read().split()[:3]}


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
                           ("e_cli", "(e) daemon, CLI per call"),
                           ("f_shm", "(f) daemon, libtorchloop + shared memory"),
                           ("g_python", "(g) daemon, Python client")):
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


PARTS = ("latency", "threshold", "throughput", "floors", "pyclient", "callgrind", "memory", "starts")


def main() -> None:
    """usage: bench.py BUILD OUT_DIR [--quick] [--parts latency,pyclient,...]

    --parts runs only the named parts (PARTS) and writes their bench.json
    (with the machine and the run's start and end) to OUT_DIR, without
    plots: a partial run is for a question of its own, not for report.py."""
    build, out_dir = sys.argv[1], sys.argv[2]
    quick = "--quick" in sys.argv
    parts = PARTS
    if "--parts" in sys.argv:
        parts = tuple(sys.argv[sys.argv.index("--parts") + 1].split(","))
        unknown = set(parts) - set(PARTS)
        if unknown:
            sys.exit(f"bench.py: unknown parts {sorted(unknown)}; parts are {', '.join(PARTS)}")
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tl-bench-")
    cache = os.path.join(tmp, "cache")
    result: dict = {"machine": machine(), "quick": quick,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    d = Daemon(build, cache, tmp)
    if parts != PARTS:
        result["parts"] = list(parts)
        try:
            if "latency" in parts:
                result["latency"] = latency(build, d, cache, tmp, quick)
            if "threshold" in parts:
                result["threshold"] = threshold(build, d, quick)
            if "throughput" in parts:
                result["throughput"] = throughput(build, d)
            if "floors" in parts:
                result["floors"] = floors(build, d, cache, tmp, quick)
            if "pyclient" in parts:
                if "latency" not in parts:
                    register(Client(d.sock), "bench.cumsum")
                result["pyclient"] = pyclient.measure(build, d.sock, "bench.cumsum", quick)
        finally:
            d.stop()
        if "callgrind" in parts:
            result["callgrind"] = callgrind_profile(build, cache, tmp)
        if "memory" in parts:
            result["memory"] = memory(build, tmp, cache)
        if "starts" in parts:
            result["starts"] = starts(build, tmp)
        result["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", os.path.join(out_dir, "bench.json"))
        return
    result["latency"] = latency(build, d, cache, tmp, quick)
    result["threshold"] = threshold(build, d, quick)
    result["throughput"] = throughput(build, d)
    big = [r for r in result["latency"] if r["N"] * r["T"] == MAX_ELEMENTS]
    if big:
        r = big[0]
        each_way = (r["N"] + r["N"] * r["T"]) * 8  # carry + inputs in, carry + outputs back
        result["payload"] = {"bytes_each_way": each_way, "d_p50_us": r["d_daemon"]["p50_us"],
                             "c_p50_us": r["c_inproc"]["p50_us"],
                             "memcpy": bench_c(build, "memcpy", each_way, 200)}
    result["floors"] = floors(build, d, cache, tmp, quick)
    print(json.dumps(result["floors"]), flush=True)
    result["pyclient"] = pyclient.measure(build, d.sock, "bench.cumsum", quick)
    print(json.dumps(result["pyclient"]), flush=True)
    d.stop()
    if not quick:
        result["callgrind"] = callgrind_profile(build, cache, tmp)
    result["memory"] = memory(build, tmp, cache)
    result["starts"] = starts(build, tmp)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    plots(out_dir, result["latency"], result["throughput"])
    print("wrote", os.path.join(out_dir, "bench.json"))


if __name__ == "__main__":
    main()

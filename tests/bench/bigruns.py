"""The large runs, in process and through the daemon over shared memory.

    .venv/bin/python tests/bench/bigruns.py BUILD OUT.json [--against OLD_BUILD [--label L]] [--rounds R]

For N = 4096, T = 128 and N = 1 048 576, T = 1 (a cumulative sum, float64):
(b) torch.compile in a Python process (bench.py's INPROC), (c) the daemon's
own artifact run in this process by `bench_c inproc`,
(f) the same scan through a daemon (`bench_c daemon ... inplace`: inputs
allocated in the connection's region, results written into it), and
(g) through the Python client with its defaults (ordinary tensors, which it
copies into the region) and (g_torchcopy) the same with that copy made by
torch's copy_ (pyclient.py's torchcopy mode), p50 µs over 300 calls, all
alternating for R rounds so that the VM's load moves them alike.

With --against, a daemon of OLD_BUILD is measured the same way, in the same
rounds (the clients, BUILD's bench_c and this checkout's Python package, are
the same for both): how a change in the daemon moves (f) against the same (c); L names
OLD_BUILD in the report.  Each round starts each daemon afresh on the shared,
warm cache and stops it after: only one daemon is alive at a time (an idle
second daemon moved the other's numbers 2-3x).
"""
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

SHAPES = [(4096, 128), (1048576, 1)]
ITERS = 300
COLUMNS = ("c", "f", "g", "g_torchcopy")


def start(build: str, cache: str) -> tuple:
    tmp = tempfile.mkdtemp(prefix="tl-bigruns-")
    d = bench.Daemon(build, cache, tmp)
    try:
        c = bench.Client(d.sock)
        sos = {}
        for n, t in SHAPES:
            name = f"bench.big{n}x{t}"
            bench.register(c, name)
            bench.timed_scan(c, name, n, t)
            sp = c.call("describe", name=name)["result"]["specializations"][0]
            sos[(n, t)] = os.path.join(cache, "objects", sp["key"] + ".so")
    except BaseException:
        d.stop()  # never leave a daemon on the socket for the next measurement
        raise
    return d, sos


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    against = sys.argv[sys.argv.index("--against") + 1] if "--against" in sys.argv else None
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    bench_c = os.path.join(build, "bench_c")
    cache = tempfile.mkdtemp(prefix="tl-bigruns-cache-")
    builds = {"this": build}
    if against:
        builds["against"] = against
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    res: dict = {label: {f"{n}x{t}": {k: [] for k in COLUMNS} for n, t in SHAPES} for label in builds}
    res_b: dict = {f"{n}x{t}": [] for n, t in SHAPES}
    py = os.path.join(bench.ROOT, ".venv", "bin", "python")
    for _ in range(rounds):
        for n, t in SHAPES:
            res_b[f"{n}x{t}"].append(bench.run_json([py, "-c", bench.INPROC, str(n), str(t), str(ITERS),
                                                     "compile"])["p50_us"])
        for label, b in builds.items():
            d, sos = start(b, cache)
            try:
                for n, t in SHAPES:
                    r = res[label][f"{n}x{t}"]
                    r["c"].append(bench.run_json([bench_c, "inproc", sos[(n, t)], str(n), str(t),
                                                  str(ITERS)])["p50_us"])
                    r["f"].append(bench.run_json([bench_c, "daemon", d.sock, f"bench.big{n}x{t}",
                                                  str(n), str(t), str(ITERS), "inplace"])["p50_us"])
                    for col, mode in (("g", "default"), ("g_torchcopy", "torchcopy")):
                        r[col].append(bench.run_json([py, "-c", bench.PYCLIENT, d.sock, f"bench.big{n}x{t}",
                                                      str(n), str(t), str(ITERS), mode])["p50_us"])
                    print(label, n, t, " ".join("%s %.0f" % (k, r[k][-1]) for k in COLUMNS), flush=True)
            finally:
                d.stop()
    for label in res:
        for r in res[label].values():
            for k in COLUMNS:
                r[k + "_median"] = statistics.median(r[k])
            r["ratio_median"] = statistics.median(f / c for f, c in zip(r["f"], r["c"]))
    b_median = {k: statistics.median(v) for k, v in res_b.items()}
    doc = {"b": res_b, "b_median": b_median, "started": started,
           "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
           "rounds": rounds, "iters": ITERS,
           "against": sys.argv[sys.argv.index("--label") + 1] if "--label" in sys.argv else against, "results": res}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print("(b)", json.dumps(b_median))
    print(json.dumps({k: {s: ([v[c + "_median"] for c in COLUMNS], round(v["ratio_median"], 2))
                          for s, v in r.items()} for k, r in res.items()}))


if __name__ == "__main__":
    main()

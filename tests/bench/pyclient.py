"""What the Python client adds to a small scan, against libtorchloop.

usage: pyclient.py BUILD_DIR SOCKET ADAPTER OUT_JSON [--quick]

Against a running daemon whose ADAPTER is bench.py's cumulative sum
(N = 4, T = 1, float64), two measures of the same clients:
  c        build/bench_c daemon ... (libtorchloop, column (d))
  fast     torchloop.Client with its C codec (torchloop._fast; column (g))
  adapter  torchloop.loop_adapter(...).scan(cumsum.body, ...): the seed's
           LoopAdapter shape, as a solver calls it (its own registration of
           the same body; autograd off, as the inputs need no gradient)
  python   torchloop.Client on _wire.py alone (the codec without the extension)

1. Wall time: p50 over 3000 scans, the three clients in turn, five rounds
   (the median round is reported, and every round): on a VM the round trip
   moves from minute to minute, so the clients are interleaved.
2. Instructions the client process executes per scan, counted by callgrind
   (`valgrind --tool=callgrind`, N1 and N2 scans, (I2 - I1) / (N2 - N1)):
   start-up cancels out, the count does not depend on the machine's load,
   and it is the client's own cost (the daemon is another process).
   OPENBLAS_NUM_THREADS=1 keeps numpy's idle BLAS threads out of the count,
   TORCHLOOP_BUSY_POLL_US=0 the clients' poll loops (their length is the
   reply's wait, not the client's work).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
BODIES = os.path.join(ROOT, "examples", "bodies")

# One client process's scans: argv sock adapter N T iters mode; mode is
# inline (shm=0), shm (every tensor through shared memory), default, python
# (defaults, without the C codec), adapter (loop_adapter's scan of
# examples/bodies/cumsum.py's body, registered by the adapter itself; argv
# then ends with the examples/bodies directory) or torchcopy (defaults, but
# inputs copied into the region by torch's copy_, which splits the copy over
# the process's OpenMP team: the client before 2026-12-02, for bigruns.py).
# Prints p50/p99 in µs as JSON.
SCANS = r"""
import json, os, sys, time, torch, torchloop
from torchloop import _wire, _shm
sock, adapter, n, steps, iters, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
if mode == "python":
    _wire.fast = None
if mode == "torchcopy":
    _shm.Region.put = lambda self, off, t: self._bytes[off:off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
kw = {"inline": dict(shm=0), "shm": dict(shm_threshold=1)}.get(mode, {})
c = torchloop.Client(sock, **kw)
scan = lambda carry, xs: c.scan(adapter, carry, xs)
if mode == "adapter":
    sys.path.insert(0, sys.argv[7])  # examples/bodies
    import cumsum
    la = torchloop.loop_adapter(max_steps=128, max_elements=1 << 20, socket=sock)
    scan = lambda carry, xs: la.scan(cumsum.body, carry, xs)
carry = torch.arange(n, dtype=torch.float64) * 0.01
xs = torch.ones(steps, n, dtype=torch.float64)
for _ in range(20): scan(carry, xs)
ts = []
for _ in range(iters):
    t0 = time.perf_counter(); out = scan(carry, xs); ts.append((time.perf_counter() - t0) * 1e6)
    del out
ts.sort()
print(json.dumps({"p50_us": ts[len(ts) // 2], "p99_us": ts[int(len(ts) * 0.99)], "shm": c._region is not None,
                  "c_codec": _wire.fast is not None}))
"""


def _run(cmd: list[str], env: dict | None = None) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout


def wall(build: str, sock: str, adapter: str, rounds: int, iters: int) -> dict:
    out: dict = {"c": [], "fast": [], "adapter": [], "python": []}
    for _ in range(rounds):
        out["c"].append(json.loads(_run([os.path.join(build, "bench_c"), "daemon", sock, adapter, "4", "1",
                                         str(iters)]))["p50_us"])
        for name, mode in (("fast", "default"), ("adapter", "adapter"), ("python", "python")):
            r = json.loads(_run([PY, "-c", SCANS, sock, adapter, "4", "1", str(iters), mode, BODIES]))
            if name == "fast" and not r["c_codec"]:
                raise RuntimeError("torchloop._fast is not built: run `make setup`")
            out[name].append(r["p50_us"])
    med = {k: sorted(v)[len(v) // 2] for k, v in out.items()}
    return {"rounds": out, "median_p50_us": med, "iters": iters}


def _instructions(cmd: list[str], tmp: str) -> int:
    # no busy polling: a poll loop's instructions count how long the reply
    # took (under valgrind, a slow client), not the client's work
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", TORCHLOOP_BUSY_POLL_US="0")
    r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.%p", *cmd],
                       capture_output=True, text=True, env=env, check=True)
    counts = re.findall(r"Collected : (\d+)", r.stderr)
    if not counts:
        raise RuntimeError("callgrind printed no count:\n" + r.stderr[-2000:])
    return int(counts[-1])


def instructions(build: str, sock: str, adapter: str, n1: int, n2: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="tl-pyclient-")
    out = {}
    for name, cmd in (("c", lambda n: [os.path.join(build, "bench_c"), "daemon", sock, adapter, "4", "1", str(n)]),
                      ("fast", lambda n: [PY, "-c", SCANS, sock, adapter, "4", "1", str(n), "default"]),
                      ("adapter", lambda n: [PY, "-c", SCANS, sock, adapter, "4", "1", str(n), "adapter",
                                             BODIES]),
                      ("python", lambda n: [PY, "-c", SCANS, sock, adapter, "4", "1", str(n), "python"])):
        a, b = (n1, n2) if name != "c" else (10 * n1, 10 * n2)
        out[name] = round((_instructions(cmd(b), tmp) - _instructions(cmd(a), tmp)) / (b - a))
    return {"per_scan": out, "scans": [n1, n2]}


def measure(build: str, sock: str, adapter: str, quick: bool) -> dict:
    res = {"wall": wall(build, sock, adapter, 3 if quick else 5, 3000)}
    try:
        res["instructions"] = instructions(build, sock, adapter, 200, 700 if quick else 1200)
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        # valgrind cannot run some CPUs' instructions (AVX-512): say so, keep the rest
        res["instructions_error"] = str(exc)[-500:]
        print("pyclient: the instruction counts could not run:", res["instructions_error"], file=sys.stderr)
    return res


def main() -> None:
    build, sock, adapter, out = sys.argv[1:5]
    res = measure(build, sock, adapter, "--quick" in sys.argv)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

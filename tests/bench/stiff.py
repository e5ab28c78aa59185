"""A stiff solver's implicit step (issue 54): torchloop against the reference and eager.

usage: stiff.py BUILD_DIR OUT_JSON [--rounds N]

The body is what an implicit solver builds: `Solver.run` makes a closure
per run over the user's RHS and Jacobian callbacks (closures over a 32-point
grid's diffusion matrix and source, float64), carry (y, None), inputs
(times [T], step sizes [T]), T = 128.  One step is linearly implicit Euler
on u_t = u_xx - k u^3 + cos(t) s(x) with Dirichlet ends:

    J = jac(t, y)                 # the tridiagonal Laplacian - 3k diag(y^2)
    A = I - h J
    y1 = torch.linalg.solve(A, y + h (rhs(t, y) - J y)),  output y1.sum()

(h |lambda_max| ~ 44: an explicit step diverges).  Methods:
  g  torchloop.loop_adapter(...).scan: the package captures the closure and
     the daemon compiles the graph
  b  the reference adapter's way (/work/shared/reference/torch_loop.txt):
     torch.compile(fullgraph=True, dynamic=False, backend="inductor") of a
     code object of its own of the loop, in process (pypath.py's (b))
  a  the eager loop (tests/python/eager.py's scan: a Python for loop over t)

first_s: a fresh process's first `solver.run` (g: capture, register, the
daemon's compile and the run, against a fresh daemon cache; b: dynamo's
trace and Inductor's compile; Inductor's FX graph and autograd caches off on
both sides, the precompiled headers in the shared Inductor directory).
g_quick: the same against a daemon with the default --quick-tier-steps 32
(T = 128 is then served by the scan op's graph first).  p50_us: warm, in one
process, interleaved for --rounds rounds (the median round's p50), after the
three results were checked against each other (1e-9): a mismatch fails the
script.  A method that raises is recorded with its message, not fatal.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from types import FunctionType
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from bench import Daemon, settle  # noqa: E402

import eager  # noqa: E402

N, T, H, K = 32, 128, 0.01, 5.0
TOL = 1e-9
Tree = tuple[torch.Tensor, None]
Step = Callable[[Tree, tuple[torch.Tensor, torch.Tensor]], tuple[Tree, torch.Tensor]]
Scan = Callable[[Step, Tree, tuple[torch.Tensor, torch.Tensor]], tuple[Tree, torch.Tensor]]
Rhs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def problem(n: int) -> tuple[Rhs, Rhs]:
    """The user's callbacks: rhs(t, y) and jac(t, y), closures over the grid."""
    dx = 1.0 / (n + 1)
    lap = (torch.diag(torch.full((n,), -2.0, dtype=torch.float64))
           + torch.diag(torch.ones(n - 1, dtype=torch.float64), 1)
           + torch.diag(torch.ones(n - 1, dtype=torch.float64), -1)) / dx ** 2
    grid = torch.linspace(dx, 1.0 - dx, n, dtype=torch.float64)
    source = 20.0 * torch.sin(torch.pi * grid)

    def rhs(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lap @ y - K * y * y * y + torch.cos(t) * source

    def jac(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lap - torch.diag(3.0 * K * y * y)

    return rhs, jac


class Solver:
    """Linearly implicit Euler: the step is built per run over the callbacks."""

    def __init__(self, rhs: Rhs, jac: Rhs, n: int) -> None:
        self.rhs, self.jac = rhs, jac
        self.eye = torch.eye(n, dtype=torch.float64)

    def run(self, scan: Scan, y0: torch.Tensor, times: torch.Tensor,
            dts: torch.Tensor) -> tuple[Tree, torch.Tensor]:
        def step(carry: Tree, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[Tree, torch.Tensor]:
            y, _ = carry
            t, h = x
            jy = self.jac(t, y)
            a = self.eye - h * jy
            y1 = torch.linalg.solve(a, y + h * (self.rhs(t, y) - jy @ y))
            return (y1, None), y1.sum()

        return scan(step, (y0, None), (times, dts))


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grid = torch.linspace(0.0, 1.0, N + 2, dtype=torch.float64)[1:-1]
    y0 = torch.sin(torch.pi * grid)
    times = torch.arange(T, dtype=torch.float64) * H
    return y0, times, torch.full((T,), H, dtype=torch.float64)


def reference() -> Scan:
    """The reference adapter's compile: a code object of its own, fullgraph Inductor."""
    fn = FunctionType(eager.scan.__code__.replace(), eager.scan.__globals__)
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False)


def scan_of(method: str, sock: str) -> Scan:
    if method == "a":
        return eager.scan
    if method == "b":
        return reference()
    import torchloop

    return torchloop.loop_adapter(max_steps=T, max_elements=1 << 16, socket=sock).scan


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4000]


def max_diff(out: tuple[Tree, torch.Tensor], ref: tuple[Tree, torch.Tensor]) -> float:
    return max((out[0][0] - ref[0][0]).abs().max().item(), (out[1] - ref[1]).abs().max().item())


Call = Callable[[], tuple[Tree, torch.Tensor]]


def timed_first(call: Call) -> tuple[dict, tuple[Tree, torch.Tensor] | None]:
    """A first call: its seconds, or (also) the message it raised."""
    t0 = time.perf_counter()
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, not fatal
        return {"first_s": time.perf_counter() - t0, "error": error_text(exc)}, None
    return {"first_s": time.perf_counter() - t0}, out


def p50_rounds(calls: dict[str, Call], rounds: int) -> dict[str, list[float]]:
    """Per method, --rounds p50s (µs), the methods interleaved (pypath.py's way):
    a 0.5 s warm-up each sets the calls per round (about 0.3 s of them)."""
    per_call = {}
    for k, fn in calls.items():
        t_end, seen = time.perf_counter() + 0.5, []
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            seen.append(time.perf_counter() - t0)
        per_call[k] = statistics.median(seen)
    p50s: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, fn in calls.items():
            ts = []
            for _ in range(max(20, min(1000, int(0.3 / max(per_call[k], 1e-6))))):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
            p50s[k].append(statistics.median(ts))
    return p50s


def child_first(sock: str) -> dict:
    """A fresh process's first torchloop scan (the daemon compiles)."""
    solver, (y0, times, dts) = Solver(*problem(N), N), inputs()
    scan = scan_of("g", sock)
    row, out = timed_first(lambda: solver.run(scan, y0, times, dts))
    if out is not None:
        row["max_diff_vs_eager"] = max_diff(out, solver.run(eager.scan, y0, times, dts))
    return row


def run_with(solver: Solver, scan: Scan,
             args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Call:
    return lambda: solver.run(scan, *args)


def child_warm(sock: str, rounds: int, with_g: bool) -> dict:
    """a's and b's first calls (a fresh process), g's first here (compiled
    already); the results checked against a; then the warm p50s."""
    solver, (y0, times, dts) = Solver(*problem(N), N), inputs()
    rows: dict[str, dict] = {}
    outs: dict[str, tuple[Tree, torch.Tensor]] = {}
    calls: dict[str, Call] = {}
    for m in ("a", "b", "g") if with_g else ("a", "b"):
        call = run_with(solver, scan_of(m, sock), (y0, times, dts))
        rows[m], out = timed_first(call)
        if out is None:
            continue
        again, _ = timed_first(call)  # a second call that compiles again cannot be timed
        if "error" in again or again["first_s"] > 10:
            rows[m]["error"] = again.get("error", f"the second call took {again['first_s']:.1f} s")
            continue
        outs[m], calls[m] = out, call
    if "a" not in outs:
        raise RuntimeError(f"the eager loop failed: {rows['a']}")
    for m in outs:
        rows[m]["max_diff_vs_eager"] = max_diff(outs[m], outs["a"])
        if rows[m]["max_diff_vs_eager"] > TOL * max(1.0, outs["a"][1].abs().max().item()):
            raise RuntimeError(f"{m} disagrees with the eager loop: {rows}")
    settle()
    p50s = p50_rounds(calls, rounds)
    for m, v in p50s.items():
        rows[m].update(p50_us=statistics.median(v), rounds_us=v)
    if "g" in calls:  # the graph's own run time in the daemon
        import torchloop

        busiest = max(torchloop.Client(sock).stats()["adapters"], key=lambda a: a["runs"])
        rows["g"]["daemon_run_us"] = busiest["run_p50_us"]
    return rows


def child(args: list[str], env: dict[str, str]) -> dict:
    settle()
    proc = subprocess.run([PY, os.path.abspath(__file__), "--child", *args], capture_output=True,
                          text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"stiff.py --child {args[0]}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_against(build: str, tmp: str, env: dict[str, str], extra: tuple[str, ...]) -> dict:
    """child_first against a daemon of its own on a fresh cache."""
    sub = tempfile.mkdtemp(dir=tmp)
    os.chmod(sub, 0o755)
    d = Daemon(build, os.path.join(sub, "cache"), sub, extra=extra, env=env)
    try:
        return child(["first", d.sock], env)
    finally:
        d.stop()


def measure(build: str, tmp: str, env: dict[str, str], rounds: int) -> dict[str, dict]:
    d = Daemon(build, os.path.join(tmp, "cache"), tmp, env=env)
    try:
        g = child(["first", d.sock], env)
        print(f"stiff: g first: {json.dumps(g)}", file=sys.stderr, flush=True)
        rows = child(["warm", d.sock, str(rounds), "0" if "error" in g else "1"], env)
    finally:
        d.stop()
    if "g" in rows:  # the warm process's first scan: capture, register (compiled), run
        warm_g = rows.pop("g")
        g["second_process_first_s"] = warm_g.pop("first_s")
        g.update({k: v for k, v in warm_g.items() if k not in g or k == "error"})
    rows["g"] = g
    # the defaults a user gets: T = 128 served first by the scan op's graph
    rows["g_quick"] = first_against(build, tmp, env, ("--quick-tier-steps", "32"))
    print(f"stiff: g quick first: {json.dumps(rows['g_quick'])}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    load_start = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="tlbench-stiff.")
    os.chmod(tmp, 0o755)
    # no FX graph or autograd cache on either side: every first call compiles;
    # both use the shared Inductor directory (its precompiled headers), as
    # bench.Daemon does
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                   os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    try:
        rows = measure(build, tmp, env, rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"T": T, "N": N, "h": H, "k": K, "rounds": rounds, "rows": rows,
           "loadavg": {"start": list(load_start), "end": list(os.getloadavg())}}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        mode, sock = sys.argv[2], sys.argv[3]
        res = child_first(sock) if mode == "first" else \
            child_warm(sock, int(sys.argv[4]), sys.argv[5] == "1")
        print(json.dumps(res))
    else:
        main()

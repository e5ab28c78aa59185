"""Capture in the solver's process, per body form (tests/helpers/bodyforms.py).

usage: capture.py BUILD_DIR OUT_JSON [--rounds N]

One daemon on a private, empty cache.  For each form (the six forms of one
step, and the solver's per-run RK2 closure), in fresh processes:
  capture_s[T]  what `loop_adapter(...).scan` spends before it sends anything
                on the first call of a process: dynamo's trace of one step,
                the export to core ATen and the graph's JSON (T = 1 and
                T = 128: the trace is one step whatever T)
  first_s       a first process's first scan (capture + register + the
                daemon's compile, N = 4, T = 1)
  second_s      a second process's first scan of the same body, once the
                graph is compiled (capture + register + a run), and
                second_rest_s what it spent past its own capture (register and
                the run); the issue's target: second_rest_s <= 50 ms
  warm_us       p50 of a warm scan through the captured path (guards checked
                by dynamo, N = 4, T = 1, no autograd), and source_us the same
                scan through `loop_adapter(capture=False)` of a module-level
                body of the same math and trees (the path before capture; the
                captured path also sends the captured tensors), measured
                interleaved in the same process once the machine is idle
                (bench.settle) and after a warm-up round of each, median of
                --rounds rounds:
                overhead_us = warm_us - source_us (target <= 10 µs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
sys.path.insert(0, HERE)
from bench import Daemon  # noqa: E402

# One process: argv sock form steps mode rounds tmp; prints JSON.
CHILD = r"""
import json, statistics, sys, time
sock, form, steps, mode, rounds, tmp = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
import torch, torchloop, bodyforms
from pathlib import Path
torch.set_num_threads(1)
ad = torchloop.loop_adapter(max_steps=128, max_elements=4096, socket=sock)
drv = ad.scan.__self__
if form == "solver":
    y0, times, dts, forcing = [t.detach() for t in bodyforms.solver_inputs(0, steps)]
    solver = bodyforms.Solver(bodyforms.rhs, 0.25)
    call = lambda scan: solver.run(scan, y0, times, dts, forcing)
else:
    body, W = bodyforms.form(form, Path(tmp))
    W.requires_grad_(False)
    c, xs = [t.detach() for t in bodyforms.inputs(0, steps)]
    call = lambda scan: scan(body, c, xs)
out = {}
if mode == "capture":
    real = drv.send
    drv.send = lambda *a, **k: {"carry": (None, ()), "outputs": None}
    t0 = time.perf_counter()
    call(ad.scan)
    out["capture_s"] = time.perf_counter() - t0
    drv.send = real
else:
    spent = []
    prepare = drv.prepare
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return prepare(*a, **k)
        finally:
            spent.append(time.perf_counter() - t)
    drv.prepare = timed
    t0 = time.perf_counter()
    call(ad.scan)
    out["first_s"] = time.perf_counter() - t0
    out["own_capture_s"] = spent[0]
    drv.prepare = prepare
if mode == "warm":
    src = torchloop.loop_adapter(max_steps=128, max_elements=4096, socket=sock, capture=False)
    if form == "solver":  # the same step and trees as a module-level body
        source_call = lambda: src.scan(bodyforms.solver_source_step, (y0, None), (times, dts))
    else:
        c, xs = [t.detach() for t in bodyforms.inputs(0, steps)]
        source_call = lambda: src.scan(bodyforms.source_step, c, xs)
    source_call()
    from bench import p50_us, settle
    settle()  # the daemon's background work (a worker starting) ends first
    p50 = lambda fn: p50_us(fn, 2000)
    warm, source = [], []
    p50(lambda: call(ad.scan)), p50(source_call)  # warm-up: the first ~0.1 s after idle runs slow
    for _ in range(rounds):
        warm.append(p50(lambda: call(ad.scan)))
        source.append(p50(source_call))
    out.update(warm_us=statistics.median(warm), source_us=statistics.median(source),
               warm_rounds=warm, source_rounds=source)
print(json.dumps(out))
"""


def child(sock: str, form: str, steps: int, mode: str, rounds: int, tmp: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "helpers"), HERE]))
    proc = subprocess.run([PY, "-c", CHILD, sock, form, str(steps), mode, str(rounds), tmp],
                          capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{form} {mode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    import bodyforms

    tmp = tempfile.mkdtemp(prefix="tlbench-capture.")
    d = Daemon(build, os.path.join(tmp, "cache"), tmp)
    rows = []
    try:
        for form in (*bodyforms.FORMS, "solver"):
            row = {"form": form, "capture_s": {}}
            for steps in (1, 128):
                row["capture_s"][str(steps)] = child(d.sock, form, steps, "capture", rounds,
                                                     tmp)["capture_s"]
            row["first_s"] = child(d.sock, form, 1, "first", rounds, tmp)["first_s"]
            warm = child(d.sock, form, 1, "warm", rounds, tmp)
            row["second_s"] = warm.pop("first_s")
            # what the second process's first scan spent past its own capture:
            # register (unchanged) + the run (the "+ 50 ms")
            row["second_rest_s"] = row["second_s"] - warm.pop("own_capture_s")
            row.update(warm)
            row["overhead_us"] = row["warm_us"] - row["source_us"]
            rows.append(row)
            print(f"capture: {form}: {json.dumps(row)}", file=sys.stderr)
    finally:
        d.stop()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"rows": rows, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()

"""A new body's first scans with `loop_adapter(eager_first=True)` and without.

usage: eagerfirst.py BUILD_DIR OUT_JSON

One daemon on a private, empty cache.  The solver's per-run RK2 closure
(tests/helpers/bodyforms.py) with a decay drawn per process, so that every
process captures a graph the daemon has never compiled; T = 16 and 128.  In
a fresh process each:
  first_s           the first scan (capture; then the compile and a run, or
                    with eager_first the eager loop while the daemon compiles)
  second_s          the second scan, right after
  until_compiled_s  from the first scan to the first scan the daemon ran
                    (scans repeated meanwhile, as a solver loop does)
  eager_scans       scans run eagerly in the process
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PY = os.path.join(ROOT, ".venv", "bin", "python")
sys.path.insert(0, HERE)
from bench import Daemon  # noqa: E402

CHILD = r"""
import json, sys, time
import torch, torchloop, bodyforms
sock, eager_first, steps, decay = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), float(sys.argv[4])
torch.set_num_threads(1)
ad = torchloop.loop_adapter(max_steps=128, max_elements=4096, socket=sock, eager_first=eager_first)
drv = ad.scan.__self__
y0, times, dts, forcing = [t.detach() for t in bodyforms.solver_inputs(0, steps)]
solver = bodyforms.Solver(bodyforms.rhs, decay)
run = lambda: solver.run(ad.scan, y0, times, dts, forcing)
t0 = time.perf_counter()
run()
first = time.perf_counter() - t0
t1 = time.perf_counter()
run()
second = time.perf_counter() - t1
eager = (lambda: drv.eager.eager_scans) if eager_first else (lambda: 0)
while True:  # the scans a solver makes until one runs in the daemon
    before = eager()
    run()
    if eager() == before:
        break
print(json.dumps({"first_s": first, "second_s": second,
                  "until_compiled_s": time.perf_counter() - t0, "eager_scans": eager()}))
"""


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp(prefix="tlbench-eagerfirst.")
    d = Daemon(build, os.path.join(tmp, "cache"), tmp)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "tests", "helpers"))
    rows = []
    try:
        for steps in (16, 128):
            for eager_first in (False, True):
                decay = 0.25 + random.random() / 100  # a graph never compiled
                proc = subprocess.run([PY, "-c", CHILD, d.sock, "1" if eager_first else "0",
                                       str(steps), repr(decay)],
                                      capture_output=True, text=True, env=env, timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                row = {"T": steps, "eager_first": eager_first,
                       **json.loads(proc.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"eagerfirst: {json.dumps(row)}", file=sys.stderr)
    finally:
        d.stop()
    with open(out_path, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

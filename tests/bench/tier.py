"""Cold T = 128 compiles of the example adapters, without and with the quick tier.

usage: tier.py BUILD_DIR OUT_JSON

For each mode -- `--quick-tier-steps 0` (the unrolled graph compiles before
the first reply: "before") and the daemon's default (the scan op's graph
serves first while the unrolled one compiles in the background: "after") --
starts a daemon as `make run` does (examples/adapters, the start-up probe on)
on a private, empty cache, then for each example adapter in turn sends one
scan at T = 128 and records: seconds until that reply (the wait a solver
sees on a cold cache), which graph served it (tier, lowered), and seconds
until the unrolled graph took over.  The next adapter is asked only once the
previous one's upgrade is over, so each first reply is one adapter's cold
compile (plus the worker's queue, empty then).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from tlwire import Client  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
T = 128


def trees(adapter: str):
    rng = np.random.default_rng(0)
    if adapter in ("cumsum", "ema"):
        return rng.standard_normal(64), rng.standard_normal((T, 64))
    if adapter == "lorenz.rk4":
        return ({k: rng.standard_normal(16) for k in ("x", "y", "z")},
                {"forcing": rng.standard_normal((T, 16)) * 0.1})
    return (rng.standard_normal((4, 8)), None), rng.standard_normal((T, 4, 3))


def spec_of(c: Client, adapter: str) -> dict:
    r = c.call("describe", name=adapter)["result"]
    (sp,) = r["specializations"]
    return sp


def run_mode(build: str, tier_steps: int | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="tlbench-tier.")
    sock, cache = os.path.join(tmp, "sock"), os.path.join(tmp, "cache")
    extra = [] if tier_steps is None else ["--quick-tier-steps", str(tier_steps)]
    log = open(os.path.join(tmp, "daemon.log"), "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [os.path.join(build, "torchloopd"), "--socket", sock, "--cache-dir", cache,
         "--adapters", os.path.join(ROOT, "examples", "adapters"), "--compile-timeout", "1800",
         *extra], stdout=log, stderr=subprocess.STDOUT)
    while True:
        try:
            if Client(sock).call("health")["result"]["ready"]:
                break
        except (OSError, EOFError, KeyError):
            pass
        if time.monotonic() - t0 > 600:
            raise RuntimeError("daemon did not start; see " + log.name)
        time.sleep(0.1)
    rows = {"ready_s": time.monotonic() - t0, "adapters": []}
    c = Client(sock)
    for adapter in ("cumsum", "ema", "lorenz.rk4", "rnn.tanh"):
        carry, inputs = trees(adapter)
        t1 = time.monotonic()
        r = c.call("scan", adapter=adapter, carry=carry, inputs=inputs)
        first = time.monotonic() - t1
        assert "result" in r, r
        sp = spec_of(c, adapter)
        row = {"adapter": adapter, "first_reply_s": first, "tier": sp["tier"],
               "lowered": sp["lowered"], "compile_s": sp["compile_seconds"]}
        while sp["upgrading"]:
            time.sleep(0.2)
            sp = spec_of(c, adapter)
        row["final_s"] = time.monotonic() - t1
        row["final_lowered"] = sp["lowered"]
        row["final_compile_s"] = sp["compile_seconds"]
        row["compiles"] = c.call("describe", name=adapter)["result"]["counters"]["compiles"]
        rows["adapters"].append(row)
        print(f"  {adapter}: first reply {first:.1f} s ({row['tier']}, {row['lowered']}), "
              f"unrolled after {row['final_s']:.1f} s", flush=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    subprocess.run(["rm", "-rf", tmp], check=False)
    return rows


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    result = {"T": T, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name, steps in (("before", 0), ("after", None)):
        print(f"{name}:", flush=True)
        result[name] = run_mode(build, steps)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""Cold T = 128 compiles of the example adapters, without and with the quick tier.

usage: tier.py BUILD_DIR OUT_JSON

For each mode -- `--quick-tier-steps 0` (the unrolled graph compiles before
the first reply: "before") and the daemon's default (the scan op's graph
serves first while the unrolled one compiles in the background: "after") --
starts a daemon as `make run` does (examples/adapters, the start-up probe on)
on a private, empty cache, then for each example adapter in turn sends one
scan at T = 128 and records: seconds until that reply (the wait a solver
sees on a cold cache), which graph served it (tier, lowered), seconds
until the final graph took over (the unrolled loop, or within
`--upgrade-budget` blocks of it: the upgrade's plan and trial), and the
daemon's run p50 over RUNS more scans on the final graph (before: the
unrolled loop's).  The next adapter is asked only once the
previous one's upgrade is over, so each first reply is one adapter's cold
compile (plus the worker's queue, empty then).

Then "busy" (the compile service's lanes, docs/operations.md): the default
daemon again on an empty cache; lorenz.rk4 first (its unrolled upgrade is
the longest of the four), and right after its first reply two new adapters
at once (ema and rnn.tanh, one thread each): their first replies while
that upgrade runs in the background, against their own "after" replies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from tlwire import Client  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
T = 128
RUNS = 1100  # more than the daemon's latency ring (1024): every run in it is the final graph's


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


def start_daemon(build: str, tier_steps: int | None) -> tuple[subprocess.Popen, str, str, float]:
    """A daemon as `make run` starts it, on a private empty cache, once ready:
    (process, socket, scratch directory, seconds to ready)."""
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
    return proc, sock, tmp, time.monotonic() - t0


def stop_daemon(proc: subprocess.Popen, tmp: str) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    subprocess.run(["rm", "-rf", tmp], check=False)


def first_reply(sock: str, adapter: str, out: dict) -> None:
    carry, inputs = trees(adapter)
    c = Client(sock)
    t1 = time.monotonic()
    r = c.call("scan", adapter=adapter, carry=carry, inputs=inputs)
    out[adapter] = time.monotonic() - t1
    assert "result" in r, r


def run_busy(build: str) -> dict:
    """Two new adapters at once while lorenz.rk4's upgrade runs."""
    proc, sock, tmp, _ = start_daemon(build, None)
    c = Client(sock)
    replies: dict[str, float] = {}
    first_reply(sock, "lorenz.rk4", replies)
    threads = [threading.Thread(target=first_reply, args=(sock, a, replies))
               for a in ("ema", "rnn.tanh")]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    both = time.monotonic() - t0
    lorenz = spec_of(c, "lorenz.rk4")
    lanes = c.call("stats")["result"]["lanes"]
    row = {"lorenz_first_s": replies["lorenz.rk4"], "ema_s": replies["ema"],
           "rnn_s": replies["rnn.tanh"], "both_s": both,
           "upgrade_running": bool(lorenz["upgrading"]),
           "preempted": lanes["background"]["preempted"],
           "foreground_workers": lanes["foreground"]["max"]}
    print(f"  busy: ema {row['ema_s']:.1f} s, rnn.tanh {row['rnn_s']:.1f} s at once "
          f"(lorenz upgrading: {row['upgrade_running']})", flush=True)
    stop_daemon(proc, tmp)
    return row


def run_p50(c: Client, adapter: str, carry: object, inputs: object) -> float:
    """The daemon's run p50 (µs, no IPC) over the adapter's last runs, once
    RUNS more scans ran on the final graph."""
    for _ in range(RUNS):
        assert "result" in c.call("scan", adapter=adapter, carry=carry, inputs=inputs)
    return float(c.call("describe", name=adapter)["result"]["counters"]["run_p50_us"])


def run_mode(build: str, tier_steps: int | None) -> dict:
    proc, sock, tmp, ready_s = start_daemon(build, tier_steps)
    rows = {"ready_s": ready_s, "adapters": []}
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
        row["run_p50_us"] = run_p50(c, adapter, carry, inputs)
        row["upgrade"] = spec_of(c, adapter).get("upgrade")  # the trial's verdict by now
        rows["adapters"].append(row)
        print(f"  {adapter}: first reply {first:.1f} s ({row['tier']}, {row['lowered']}), "
              f"final ({row['final_lowered']}) after {row['final_s']:.1f} s", flush=True)
    stop_daemon(proc, tmp)
    return rows


def main() -> None:
    build, out = sys.argv[1], sys.argv[2]
    result = {"T": T, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for name, steps in (("before", 0), ("after", None)):
        print(f"{name}:", flush=True)
        result[name] = run_mode(build, steps)
    print("busy:", flush=True)
    result["busy"] = run_busy(build)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

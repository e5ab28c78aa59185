"""Checkpointed backward (`adapter.checkpoint(body)`) against the plain one.

usage: checkpoint.py BUILD_DIR OUT_JSON [--rounds N]

A step with large intermediates (an MLP update of a [64, 256] float64
state through a 2 048-wide hidden layer), T = 128, carry and inputs
requiring grad; `f, ys = adapter.scan(body, h0, xs); (f.sum() +
ys.sum()).backward()` with body plain and checkpointed, through the
captured path (the closure's weights are params).

Per variant, in a daemon of its own on the shared cache (the graphs are
compiled by a first daemon, so no compile is measured and no memory a
previous variant freed is reused):
  daemon_peak_mib  the daemon's peak RSS over its RSS before the backward
                   (VmHWM after resetting it, /proc/PID/clear_refs): the grad
                   graph's working memory (plus its inputs and results),
                   with malloc returning large blocks at once (MALLOC_ENV)
  client_peak_mib  the same for this process over forward + backward
  fwd_bwd_ms       p50 of --rounds forward + backward, warm (bwd_ms: the
                   backward's part), in daemons of their own with glibc's
                   default malloc (MALLOC_ENV would slow the loops)
at T = 1 and T = 128; the bound the issue sets, carry x T + one step: the
peak of a T = 1 backward holds one step's intermediates with the request's
own inputs, cotangents and results, so bound = carry x T + that peak; and
the growth per step beyond T = 1 against the carry's size.  (For scale,
step_intermediates_mib: every tensor one step's forward and VJP produce,
summed; make_fx of one step.)
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import Daemon  # noqa: E402

import torchloop  # noqa: E402

T, B, N, HIDDEN = 128, 64, 256, 2048
MIB = 1 << 20


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    w1 = torch.randn(N, HIDDEN, generator=gen, dtype=torch.float64) / N ** 0.5
    w2 = torch.randn(HIDDEN, N, generator=gen, dtype=torch.float64) / HIDDEN ** 0.5
    return w1, w2


def make_body(w1: torch.Tensor, w2: torch.Tensor):  # noqa: ANN201 - a closure
    def body(h: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = torch.tanh(h @ w1)
        h2 = h + 0.1 * torch.tanh(u @ w2 + x)
        return h2, (h2 * h2).mean()

    return body


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    h0 = torch.randn(B, N, generator=gen, dtype=torch.float64).requires_grad_()
    xs = torch.randn(steps, N, generator=gen, dtype=torch.float64).requires_grad_()
    return h0, xs


def step_bytes(body) -> int:  # noqa: ANN001
    """Bytes of every tensor one step's forward and VJP produce."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import vjp

    def joint(h: torch.Tensor, x: torch.Tensor, gh: torch.Tensor, gy: torch.Tensor):  # noqa: ANN202
        _, pull = vjp(body, h, x)
        return pull((gh, gy))

    h, x = torch.zeros(B, N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(h, x, h, torch.zeros((), dtype=torch.float64))
    total = 0
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


def status_kb(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def peak_of(pid: int | str, fn) -> float:  # noqa: ANN001
    """MiB that fn() raised pid's peak RSS above its RSS before."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status_kb(pid, "VmRSS")
    fn()
    return (status_kb(pid, "VmHWM") - before) / 1024


def measure(sock: str, pid: int, checkpointed: bool, steps: int, rounds: int,
            memory: bool) -> dict:
    """memory: the peaks (the daemon and this process under MALLOC_ENV);
    else the times, under glibc's default malloc."""
    ad = torchloop.loop_adapter(max_steps=T, max_elements=1 << 20, socket=sock)
    body = make_body(*weights())
    if checkpointed:
        body = ad.checkpoint(body)
    h0, xs = data(steps)

    def fwd_bwd() -> None:
        h0.grad = xs.grad = None
        f, ys = ad.scan(body, h0, xs)
        (f.sum() + ys.sum()).backward()

    fwd_bwd()  # both graphs loaded, the client warm
    if memory:
        f, ys = ad.scan(body, h0, xs)
        loss = f.sum() + ys.sum()
        return {"daemon_peak_mib": peak_of(pid, loss.backward),
                "client_peak_mib": peak_of("self", fwd_bwd)}
    times, backs = [], []
    for _ in range(rounds):
        h0.grad = xs.grad = None
        t0 = time.perf_counter()
        f, ys = ad.scan(body, h0, xs)
        t1 = time.perf_counter()
        (f.sum() + ys.sum()).backward()
        t2 = time.perf_counter()
        times.append((t2 - t0) * 1e3)
        backs.append((t2 - t1) * 1e3)
    return {"fwd_bwd_ms": statistics.median(times), "bwd_ms": statistics.median(backs),
            "grads": [h0.grad.clone(), xs.grad.clone()]}


# Peaks are measured with glibc's malloc at a fixed mmap threshold: a freed
# large tensor goes back to the system at once, so the peak RSS is the peak
# of live memory (with the default, growing threshold, freed memory stays and
# a later run reuses it unseen).  Times are not: that setting makes every
# large allocation an mmap and its first touch page faults, which a loop
# allocating its step's intermediates each iteration pays T times (here it
# made the checkpointed backward 1.74x the plain one instead of 1.41x); a
# solver's process runs with the default.  The daemons get it through their
# environment; this process, after its timing runs, from mallopt.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
M_MMAP_THRESHOLD = -3


def main() -> None:
    build, out_path = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="tlbench-ckpt.")
    cache = os.path.join(tmp, "cache")
    variants = [(f"{name} T={steps}", ck, steps) for steps in (1, T)
                for name, ck in (("plain", False), ("checkpointed", True))]
    d = Daemon(build, cache, tmp)
    try:  # compile every graph once
        for _, checkpointed, steps in variants:
            measure(d.sock, d.proc.pid, checkpointed, steps, 1, memory=False)
    finally:
        d.stop()
    rows: dict[str, dict] = {name: {} for name, _, _ in variants}
    for memory in (False, True):  # the times first: mallopt cannot be undone
        if memory:
            ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
        env = dict(os.environ, **MALLOC_ENV) if memory else dict(os.environ)
        for i, (name, checkpointed, steps) in enumerate(variants):
            d = Daemon(build, cache, tmp, sock=f"sock-{int(memory)}-{i}", env=env)
            try:
                rows[name].update(measure(d.sock, d.proc.pid, checkpointed, steps, rounds, memory))
            finally:
                d.stop()
            print(f"checkpoint: {name}: "
                  f"{ {k: v for k, v in rows[name].items() if k != 'grads'} }", file=sys.stderr)
    for steps in (1, T):
        for a, b in zip(rows[f"plain T={steps}"].pop("grads"),
                        rows[f"checkpointed T={steps}"].pop("grads")):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    carry = B * N * 8 / MIB
    plain, ck = rows[f"plain T={T}"], rows[f"checkpointed T={T}"]
    out = {"T": T, "state": [B, N], "hidden": HIDDEN, "rounds": rounds, "rows": rows,
           "carry_mib": carry, "step_intermediates_mib": step_bytes(make_body(*weights())) / MIB,
           # what the backward holds beyond a T = 1 backward (its I/O and one
           # step): per further step, against the carry's size
           "plain_growth_per_step_mib": (plain["daemon_peak_mib"]
                                         - rows["plain T=1"]["daemon_peak_mib"]) / (T - 1),
           "checkpointed_growth_per_step_mib": (ck["daemon_peak_mib"]
                                                - rows["checkpointed T=1"]["daemon_peak_mib"])
           / (T - 1),
           "time_ratio": ck["fwd_bwd_ms"] / plain["fwd_bwd_ms"],
           "bwd_ratio": ck["bwd_ms"] / plain["bwd_ms"]}
    # the bound: carry x T + one step (the T = 1 backward: one step's
    # intermediates, the request's inputs, cotangents and results)
    out["bound_mib"] = carry * T + rows["checkpointed T=1"]["daemon_peak_mib"]
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out), file=sys.stderr)


if __name__ == "__main__":
    main()

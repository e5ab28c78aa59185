"""Solvers do not see a daemon restart (torchloop/client.py Client.call): a
request whose connection broke before any byte of its reply arrived, or that
a stopping daemon refused (SHUTTING_DOWN), is sent again once on a new
connection, waiting for the daemon to listen again; a loop_adapter then
registers its graph again as it does for any daemon that forgot it.

A solver loop of 1 000 scans (a closure over a captured tensor, carry fed
back) while another thread stops the daemon with SIGTERM and starts a new
one mid-loop: nothing raises and every result matches the eager loop.  The
loop scans on while the daemon stops and, from scan WAIT_AT, waits until it
has stopped, so the scans after it must reach the new daemon: the
adapter's client counts at least one request sent again (Client.resends),
and the new daemon counts those scans.  Then the daemon stops for good: a
scan waits `reconnect` seconds and raises ConnectionLost, nothing sent
again.  Requests that must not run twice (unregister) are not sent again.
Compiles: one (T = 3; the restarted daemon loads it from the cache).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import torchloop
from conftest import _wait_ready, start_daemon, stop_daemon
from torchloop.errors import ConnectionLost

N, T, SCANS, RESTART_AT, WAIT_AT = 4, 3, 1000, 300, 600


def make_body(w: torch.Tensor):
    def body(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = 0.5 * c + torch.tanh(w * x)
        return c, c.sum()

    return body


def eager(body, c: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ys = []
    for t in range(xs.shape[0]):
        c, y = body(c, xs[t])
        ys.append(y)
    return c, torch.stack(ys)


def up(tmp: Path) -> subprocess.Popen:
    """A daemon on tmp/sock, ready."""
    proc = start_daemon(tmp)
    _wait_ready(str(tmp / "sock"), proc, tmp / "log")
    return proc


@pytest.fixture
def tmp() -> Path:
    d = Path(tempfile.mkdtemp(prefix="torchloop-restart-", dir=os.environ.get("TORCHLOOP_TEST_TMP")))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_solver_loop_goes_on_across_a_daemon_restart(tmp: Path) -> None:
    proc = up(tmp)
    halfway, down, restarted = threading.Event(), threading.Event(), threading.Event()
    procs = [proc]

    def restart() -> None:
        halfway.wait()
        try:
            stop_daemon(procs[0], tmp)  # in-flight requests are answered, then it closes
            procs.append(start_daemon(tmp))  # listening again after its start-up
            restarted.set()
        finally:
            down.set()  # the old daemon is gone (or this thread failed: the loop goes on)

    th = threading.Thread(target=restart)
    th.start()
    try:
        adapter = torchloop.loop_adapter(max_steps=8, max_elements=64, socket=str(tmp / "sock"))
        body = make_body(torch.linspace(0.5, 1.5, N, dtype=torch.float64))
        gen = torch.Generator().manual_seed(3)
        c = torch.rand(N, dtype=torch.float64, generator=gen)
        for i in range(SCANS):
            if i == RESTART_AT:
                halfway.set()
            if i == WAIT_AT:
                down.wait()  # the scans from here cannot reach the old daemon
            xs = torch.rand(T, N, dtype=torch.float64, generator=gen)
            want_c, want_ys = eager(body, c, xs)
            c, ys = adapter.scan(body, c, xs)  # carry fed back, as a solver does
            torch.testing.assert_close(c, want_c, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ys, want_ys, rtol=1e-12, atol=1e-12)
        th.join()
        assert restarted.is_set() and len(procs) == 2
        # a request was sent again, and the last scans ran on the new daemon
        assert adapter.scan.__self__.client.resends >= 1
        with torchloop.Client(str(tmp / "sock")) as client:
            assert client.stats()["requests"] >= SCANS - WAIT_AT
            assert client.resends == 0
    finally:
        halfway.set()  # a loop that failed early: the thread still ends
        th.join()
        stop_daemon(procs[-1], tmp)


def test_a_daemon_that_stays_down_is_reported_after_the_reconnect_wait(tmp: Path) -> None:
    proc = up(tmp)
    client = torchloop.Client(str(tmp / "sock"), reconnect=1.0)
    assert client.health()["live"]
    stop_daemon(proc, tmp)
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost, match="cannot connect"):
        client.health()
    assert 1.0 <= time.monotonic() - t0 < 10
    assert client.resends == 0  # no daemon came back: nothing was sent again


def test_a_request_that_must_not_run_twice_is_not_sent_again(tmp: Path) -> None:
    proc = up(tmp)
    client = torchloop.Client(str(tmp / "sock"), reconnect=30.0)
    assert client.health()["live"]
    stop_daemon(proc, tmp)
    proc = up(tmp)
    try:
        with pytest.raises(ConnectionLost) as lost:
            client.unregister("anything")  # on the old connection: lost, not retried
        assert lost.value.unanswered
        assert client.resends == 0
        assert client.health()["live"]  # the next call connects again
        assert client.resends == 0  # on a new connection: sent once
    finally:
        stop_daemon(proc, tmp)

"""A real torchloopd for the Python client's tests: one per test session, on
a private socket, sharing the run's compile cache (TORCHLOOP_TEST_CACHE) so
each specialization compiles once per checkout.  The daemon binary is the
build under test (TORCHLOOP_TEST_BUILD: build, or build-san for make sanitize).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # bodyforms.py


def _wait_ready(sock: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    import torchloop

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"torchloopd exited ({proc.returncode}) during start-up:\n{log.read_text()}")
        try:
            with torchloop.Client(sock) as c:
                if c.health().get("ready"):
                    return
        except torchloop.TorchloopError:
            pass
        time.sleep(0.1)
    pytest.fail(f"torchloopd not ready within {timeout} s:\n{log.read_text()}")


def start_daemon(tmp: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """A torchloopd on tmp/sock with the run's cache, logging (appending) to
    tmp/log; not waited for.  prefix: a command that runs it (its argv)."""
    build = os.environ.get("TORCHLOOP_TEST_BUILD", "build")
    cache = os.environ.get("TORCHLOOP_TEST_CACHE", str(ROOT / "build" / "test-cache"))
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    with open(tmp / "log", "ab") as out:
        return subprocess.Popen(
            [*prefix, str(ROOT / build / "torchloopd"), "--socket", str(tmp / "sock"), "--cache-dir",
             cache, "--no-probe", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env)


def stop_daemon(proc: subprocess.Popen, tmp: Path) -> None:
    """SIGTERM, and the exit status checked to be 0."""
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    assert rc == 0, f"torchloopd exit {rc}:\n{(tmp / 'log').read_text()}"


@contextlib.contextmanager
def running_daemon(tmp: Path, *extra: str, prefix: tuple[str, ...] = ()) -> Iterator[str]:
    """A torchloopd on tmp/sock with the run's cache; stopped and checked to exit 0."""
    proc = start_daemon(tmp, *extra, prefix=prefix)
    try:
        _wait_ready(str(tmp / "sock"), proc, tmp / "log")
        yield str(tmp / "sock")
    finally:
        stop_daemon(proc, tmp)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The socket of a running daemon (stopped, and checked to exit 0, at the end)."""
    with running_daemon(tmp_path_factory.mktemp("daemon")) as sock:
        yield sock


@pytest.fixture(scope="session")
def open_daemon() -> Iterator[str]:
    """A daemon every uid can reach (socket 0666 in a 0755 directory), holding
    at most 4 captured graphs per uid: for the non-admin tests."""
    # under the run's scratch when there is one (0755; run-tests.sh counts
    # compiles in the logs there)
    tmp = Path(tempfile.mkdtemp(prefix="torchloop-open-", dir=os.environ.get("TORCHLOOP_TEST_TMP")))
    tmp.chmod(0o755)
    try:
        with running_daemon(tmp, "--socket-mode", "0666", "--max-graphs-per-uid", "4") as sock:
            yield sock
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

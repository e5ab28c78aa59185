"""A compile worker whose background-lane compiles wait for a gate: each
waits until the file TORCHLOOP_TEST_GATE names exists, then compiles as the
real worker (daemon/worker/compile_worker.py) does.  An upgrade that cannot
end until the test says so, for tests/e2e/test_lanes.c: with one queue for
every compile, a request behind it would never be answered.  Its script hash
differs from the real worker's, so its artifacts never share cache keys
with real ones.

TORCHLOOP_TEST_READY_GATE holds the worker's import of the compile path
(at its first job, or after hello: TORCHLOOP_WORKER_PRELOAD) until the file
it names exists: a worker that is not ready for as long as the test says;
TORCHLOOP_TEST_HELLO_GATE holds its start, before hello.  For
tests/e2e/test_worker_ready.c.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "daemon", "worker"))
import compile_worker as cw  # noqa: E402

_handle = cw.handle
_import_compile_path = cw.import_compile_path


def wait_for(gate: str) -> None:
    while not os.path.exists(gate):
        time.sleep(0.05)


def handle(req: dict[str, Any]) -> dict[str, Any]:
    gate = os.environ.get("TORCHLOOP_TEST_GATE", "")
    if req.get("op") == "compile" and req.get("lane") == "background" and gate:
        cw.log(f"background compile: waiting for {gate}")
        wait_for(gate)
    return _handle(req)


def import_compile_path() -> None:
    gate = os.environ.get("TORCHLOOP_TEST_READY_GATE", "")
    if gate:
        cw.log(f"ready gate: waiting for {gate}")
        wait_for(gate)
        cw.log("ready gate: open")
    _import_compile_path()


cw.handle = handle
cw.import_compile_path = import_compile_path

if __name__ == "__main__":
    hello_gate = os.environ.get("TORCHLOOP_TEST_HELLO_GATE", "")
    if hello_gate:
        cw.die_with_daemon()  # a worker the daemon never hears from still dies with it
        cw.log(f"hello gate: waiting for {hello_gate}")
        wait_for(hello_gate)
    sys.exit(cw.main())

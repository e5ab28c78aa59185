"""A compile worker whose background-lane compiles wait for a gate: each
waits until the file TORCHLOOP_TEST_GATE names exists, then compiles as the
real worker (daemon/worker/compile_worker.py) does.  An upgrade that cannot
end until the test says so, for tests/e2e/test_lanes.c: with one queue for
every compile, a request behind it would never be answered.  Its script hash
differs from the real worker's, so its artifacts never share cache keys
with real ones.
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


def handle(req: dict[str, Any]) -> dict[str, Any]:
    gate = os.environ.get("TORCHLOOP_TEST_GATE", "")
    if req.get("op") == "compile" and req.get("lane") == "background" and gate:
        cw.log(f"background compile: waiting for {gate}")
        while not os.path.exists(gate):
            time.sleep(0.05)
    return _handle(req)


cw.handle = handle

if __name__ == "__main__":
    sys.exit(cw.main())

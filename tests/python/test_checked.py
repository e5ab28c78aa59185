"""Register checks remembered (daemon/base/cache_checked.c, issue 56): a
definition the compile worker checked once is registered again -- by this
daemon or another on the same cache -- without a check job, so without a
worker importing torch.  What is compared: with TORCHLOOP_WORKER_PRELOAD=0
(a worker imports its compile path at its first job), the second daemon's
worker never imported it, and its log says why, against a first daemon that
ran the check.  A changed definition (another entry of the same text),
a failed one (BODY_ERROR both times: failures are never remembered) and a
damaged record file (a miss, checked again) each run the check.  A private
cache, no probe, no scan: 0 compiles; two workers import torch (the first
daemon's check, the second's)."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

import torchloop

import conftest

SOURCE = f'''# {uuid.uuid4()}: a text no other run has checked
def body(carry, x):
    return carry + x, carry

def body2(carry, x):
    return carry * x, carry
'''
BROKEN = "def body(carry, x):\n    return carry +\n"
REMEMBERED = "checked before (the cache remembers it): no check job"


IMPORTED = "compile path imported"


def imports(log: Path) -> int:
    """Jobs workers got: each worker imports its compile path at its first."""
    return log.read_text().count(IMPORTED)


def test_a_passed_check_is_not_run_again_and_nothing_else_is_remembered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHLOOP_WORKER_PRELOAD", "0")
    tmp = Path(tempfile.mkdtemp(prefix="torchloop-checked-", dir=os.environ.get("TORCHLOOP_TEST_TMP")))
    tmp.chmod(0o755)
    cache = tmp / "cache"
    args = ("--cache-dir", str(cache), "--no-probe")
    (tmp / "a").mkdir()
    with conftest.running_daemon(tmp / "a", *args) as sock:
        with torchloop.Client(sock) as c:
            assert c.register("ck.one", SOURCE, body_file="ck_one.py")["name"] == "ck.one"
    assert imports(tmp / "a" / "log") == 1  # the check ran here
    assert REMEMBERED not in (tmp / "a" / "log").read_text()
    assert (cache / "checked").stat().st_size > 0

    (tmp / "b").mkdir()
    with conftest.running_daemon(tmp / "b", *args) as sock:
        with torchloop.Client(sock) as c:
            assert c.register("ck.one", SOURCE, body_file="ck_one.py")["name"] == "ck.one"
            assert imports(tmp / "b" / "log") == 0, "a remembered check ran a job"
            assert (tmp / "b" / "log").read_text().count(REMEMBERED) == 1
            assert c.describe("ck.one")["name"] == "ck.one"
            # another entry of the same text: another definition, checked
            assert c.register("ck.two", SOURCE, entry="body2", body_file="ck_one.py")["name"] == "ck.two"
            assert imports(tmp / "b" / "log") == 1
            assert (tmp / "b" / "log").read_text().count(REMEMBERED) == 1
            # a failure is never remembered: refused the second time too
            for _ in range(2):
                with pytest.raises(torchloop.TorchloopError) as e:
                    c.register("ck.bad", BROKEN, body_file="ck_bad.py")
                assert e.value.code == "BODY_ERROR", e.value
            assert (tmp / "b" / "log").read_text().count(REMEMBERED) == 1
            # a damaged record file: a miss, checked again, and served on
            (cache / "checked").write_bytes(os.urandom((cache / "checked").stat().st_size))
            assert c.register("ck.three", SOURCE, body_file="ck_one.py")["name"] == "ck.three"
            assert (tmp / "b" / "log").read_text().count(REMEMBERED) == 1
            assert c.health()["live"]

"""The compile worker's framing (daemon/worker/torchloop_worker/frames.py)
against hostile text: a well-framed job whose strings are not UTF-8 is
answered with BAD_REQUEST naming the field, and the worker serves on (the
daemon refuses such text first; this is the second wall: once, each such
frame made the worker exit).  Its log lines are one line per call,
tracebacks too, with control characters escaped.  No torch import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker import frames  # noqa: E402


def frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def raw_str(data: bytes) -> bytes:
    """A msgpack str whose bytes are data, whatever they are."""
    assert len(data) < 256
    return b"\xd9" + bytes([len(data)]) + data


def bad_job(rid: int, field: str, data: bytes) -> bytes:
    return frame(b"\x83" + msgpack.packb("id") + msgpack.packb(rid) + msgpack.packb("op")
                 + msgpack.packb("check") + msgpack.packb(field) + raw_str(data))


def replies(out: bytes) -> list[dict[str, object]]:
    got = []
    while out:
        n = int.from_bytes(out[:4], "big")
        got.append(msgpack.unpackb(out[4:4 + n]))
        out = out[4 + n:]
    return got


def test_jobs_whose_text_is_not_utf8_are_answered_and_the_worker_serves_on() -> None:
    jobs = (bad_job(1, "body_graph", b'{"k": "\xff\xfe"}')
            + bad_job(2, "body_file", b"/tmp/\xc0\xafx.py")
            + bad_job(3, "entry", b"\xed\xa0\x80"))
    out = subprocess.run([sys.executable, "compile_worker.py"], cwd=ROOT / "daemon" / "worker",
                         input=jobs, env={**os.environ, "TORCHLOOP_WORKER_PRELOAD": "0"},
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]  # EOF after the jobs, not a crash
    got = replies(out.stdout)
    assert [r["id"] for r in got] == [1, 2, 3]
    for r, field in zip(got, ["body_graph", "body_file", "entry"]):
        assert r["error"]["code"] == "BAD_REQUEST" and r["error"]["path"] == field, r
    assert "bad frame" not in out.stderr.decode()


def test_a_log_call_is_one_line_whatever_it_holds(capsys: object) -> None:
    try:
        raise ValueError("key 'a\nworker[1]: forged'\r\x1b[2J")
    except ValueError:
        import traceback
        frames.log(traceback.format_exc())
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.count("\n") == 1 and err.endswith("\n")
    assert "\r" not in err and "\x1b" not in err
    assert "Traceback (most recent call last):\\x0a" in err
    assert "'a\\x0aworker[1]: forged'\\x0d\\x1b[2J" in err

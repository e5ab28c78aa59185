"""A test-only hook: the worker, inside its sandbox, tries what the sandbox
forbids and says how each attempt ended (tests/e2e/test_sandbox.c).

TORCHLOOP_TEST_SANDBOX_PROBE holds a JSON object of targets the test chose:
``files`` (name -> a path the worker must not create), ``read`` (name ->
a file it must not read, or a directory it must not list), ``replace`` (an
existing cache entry it must neither overwrite nor replace), ``unix`` (name
-> a socket path it must not connect to), ``tcp`` (a loopback port),
``pid`` (the daemon's pid: no signal, no ptrace, no write to its memory).
The result is one stderr line, relayed into the daemon's log:
``sandbox probe: name=ERRNO ...`` with ``OK`` where an act succeeded.  Its
scratch ($TMPDIR) must say OK.  Nothing a client sends reaches it: the
variable comes from the daemon's environment.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import os
import socket
from typing import Any, Callable

PTRACE_ATTACH = 16


def _outcome(act: Callable[[], Any]) -> str:
    try:
        act()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return "OK"


def _create(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    os.unlink(path)


def _replace(path: str) -> None:
    mine = os.path.join(os.environ.get("TMPDIR", "/tmp"), "replacement")
    with open(mine, "wb") as f:
        f.write(b"not the artifact")
    os.replace(mine, path)


def _read(path: str) -> None:
    if os.path.isdir(path):
        os.listdir(path)
        return
    with open(path, "rb") as f:
        f.read(1)


def _connect(family: int, address: Any) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.connect(address)


def _ptrace(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.ptrace(PTRACE_ATTACH, pid, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")


def _write_mem(pid: int) -> None:
    os.close(os.open(f"/proc/{pid}/mem", os.O_WRONLY))


def probe(spec: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, path in spec.get("files", {}).items():
        out[name] = _outcome(functools.partial(_create, path))
    for name, path in spec.get("read", {}).items():
        out["read_" + name] = _outcome(functools.partial(_read, path))
    if "replace" in spec:
        out["replace"] = _outcome(lambda: _replace(spec["replace"]))
        out["overwrite"] = _outcome(lambda: os.close(os.open(spec["replace"], os.O_WRONLY)))
    for name, path in spec.get("unix", {}).items():
        out[name] = _outcome(functools.partial(_connect, socket.AF_UNIX, path))
    if "tcp" in spec:
        out["tcp"] = _outcome(lambda: _connect(socket.AF_INET, ("127.0.0.1", int(spec["tcp"]))))
    pid = int(spec.get("pid", os.getppid()))
    out["kill"] = _outcome(lambda: os.kill(pid, 0))
    out["ptrace"] = _outcome(lambda: _ptrace(pid))
    out["mem"] = _outcome(lambda: _write_mem(pid))
    out["scratch"] = _outcome(lambda: _create(os.path.join(os.environ.get("TMPDIR", "/tmp"), "mine")))
    return out


def run(text: str) -> str:
    """The log line for the targets in text."""
    got = probe(json.loads(text))
    return "sandbox probe: " + " ".join(f"{k}={v}" for k, v in got.items())

"""A connection to torchloopd: one request at a time, like libtorchloop.

The socket defaults like libtorchloop's: $TORCHLOOP_SOCKET, else
$XDG_RUNTIME_DIR/torchloopd/torchloopd.sock, else
/tmp/torchloopd-$UID/torchloopd.sock.  A Client is safe to share between
threads (requests are serialised by a lock) and reconnects after a fork, so
a solver's child processes never share its socket.
"""

from __future__ import annotations

import os
import socket as _socket
import struct
import threading
from typing import Any, Callable

from . import _wire
from .errors import ConnectionLost, TorchloopError, from_reply

PROTOCOL = 1


def default_socket() -> str:
    env = os.environ.get("TORCHLOOP_SOCKET")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "torchloopd", "torchloopd.sock")
    return f"/tmp/torchloopd-{os.getuid()}/torchloopd.sock"


class Client:
    """One connection; methods send one request and wait for its reply."""

    def __init__(self, socket: str | None = None, timeout: float | None = None) -> None:
        self.path = socket or default_socket()
        self.timeout = timeout
        self._sock: _socket.socket | None = None
        self._pid = 0
        self._next_id = 0
        self._lock = threading.Lock()
        self.on_event: Callable[[dict], None] | None = None

    # ---- the connection -------------------------------------------------

    def _connect(self) -> _socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        self._sock = None  # a fork's copy of the parent's socket is never used
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost("IO", f"cannot connect to torchloopd at {self.path}: {exc}") from exc
        self._sock, self._pid = sock, os.getpid()
        self._hello()
        return sock

    def _hello(self) -> None:
        reply = self._roundtrip("hello", {"protocol": PROTOCOL})
        if reply.get("protocol") != PROTOCOL:
            raise TorchloopError("VERSION_MISMATCH", f"daemon speaks protocol {reply.get('protocol')}")

    def close(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- frames ---------------------------------------------------------

    def _send(self, buffers: list[Any]) -> None:
        sock = self._sock
        assert sock is not None
        views = [memoryview(b).cast("B") for b in buffers]
        while views:
            try:
                sent = sock.sendmsg(views)
            except OSError as exc:
                self._drop()
                raise ConnectionLost("IO", f"write to torchloopd: {exc}") from exc
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]

    def _read_exact(self, buf: memoryview) -> None:
        sock = self._sock
        assert sock is not None
        got = 0
        while got < len(buf):
            try:
                n = sock.recv_into(buf[got:])
            except OSError as exc:
                self._drop()
                raise ConnectionLost("IO", f"read from torchloopd: {exc}") from exc
            if n == 0:
                self._drop()
                raise ConnectionLost("IO", "torchloopd closed the connection")
            got += n

    def _recv(self) -> dict:
        head = bytearray(4)
        self._read_exact(memoryview(head))
        (length,) = struct.unpack(">I", head)
        if length > _wire.FRAME_MAX:
            self._drop()
            raise ConnectionLost("FRAME_TOO_LARGE", f"reply of {length} bytes")
        body = bytearray(length)
        self._read_exact(memoryview(body))
        msg = _wire.decode(body)
        if not isinstance(msg, dict):
            raise TorchloopError("MSGPACK_INVALID", "reply is not a map")
        return msg

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None

    def _roundtrip(self, op: str, fields: dict[str, Any]) -> dict:
        self._next_id += 1
        rid = self._next_id
        enc = _wire.Encoder()
        enc.value({"id": rid, "op": op, **fields})
        self._send(enc.frame())
        while True:
            reply = self._recv()
            if "event" in reply:
                if self.on_event is not None:
                    self.on_event(reply)
                continue
            if reply.get("id") != rid:
                if "error" in reply and reply.get("id") is None:
                    raise from_reply(reply["error"])  # a frame-level error
                continue
            if "error" in reply:
                raise from_reply(reply["error"])
            return reply.get("result", {})

    def call(self, op: str, **fields: Any) -> dict:
        """Sends one request and returns its result map (raises on an error reply)."""
        with self._lock:
            self._connect()
            return self._roundtrip(op, fields)

    # ---- ops --------------------------------------------------------------

    def health(self) -> dict:
        return self.call("health")

    def register(self, name: str, source: str, entry: str = "body", *,
                 body_file: str | None = None, max_steps: int | None = None,
                 max_elements: int | None = None, recompile_budget: int | None = None,
                 strategy: str | None = None) -> dict:
        fields: dict[str, Any] = {"name": name, "body_source": source, "entry": entry}
        for key, value in (("body_file", body_file), ("max_steps", max_steps),
                           ("max_elements", max_elements),
                           ("recompile_budget", recompile_budget), ("strategy", strategy)):
            if value is not None:
                fields[key] = value
        return self.call("register", **fields)

    def unregister(self, name: str) -> dict:
        return self.call("unregister", name=name)

    def describe(self, name: str) -> dict:
        return self.call("describe", name=name)

    def list(self) -> list[dict]:
        return self.call("list")["adapters"]

    def stats(self) -> dict:
        return self.call("stats")

    def scan(self, adapter: str, carry: Any, inputs: Any) -> tuple[Any, Any]:
        """(final carry, stacked outputs) for one scan; trees keep their structure."""
        res = self.call("scan", adapter=adapter, carry=carry, inputs=inputs)
        return res["carry"], res["outputs"]

    def grad(self, adapter: str, carry: Any, inputs: Any, cot_carry: Any = None,
             cot_outputs: Any = None) -> dict:
        """The scan and its vector-Jacobian product: keys carry, outputs, grad_carry, grad_inputs."""
        return self.call("grad", adapter=adapter, carry=carry, inputs=inputs,
                         cot_carry=cot_carry, cot_outputs=cot_outputs)

"""A connection to torchloopd: one request at a time, like libtorchloop.

The socket defaults like libtorchloop's: $TORCHLOOP_SOCKET, else
$XDG_RUNTIME_DIR/torchloopd/torchloopd.sock, else
/tmp/torchloopd-$UID/torchloopd.sock.  A Client is safe to share between
threads (requests are serialised by a lock) and reconnects after a fork, so
a solver's child processes never share its socket.

Shared memory (docs/protocol.md "Shared memory"): once a scan or grad
carries a tensor of at least `shm_threshold` bytes, the client creates a
sealed memfd region (`shm` bytes, default 64 MiB, more if one request needs
it), passes it to the daemon, and from then on sends such tensors by
reference: tensors already in the region (`Client.empty`, or results of an
earlier call fed back in) without a copy, others copied into it.  Results
of that size come back as views of the region, freed when the last view is
gone.  `shm=0` keeps everything on the socket.  After a fork the child gets
a connection and a region of its own.
"""

from __future__ import annotations

import os
import socket as _socket
import struct
import threading
import time
from typing import Any, Callable

import torch

from . import _wire
from ._shm import Area, Region
from .errors import ConnectionLost, TorchloopError, from_reply, unanswered

PROTOCOL = 1
SHM_DEFAULT = 64 << 20
# Tensors below this many bytes travel inline: measured by `make bench`
# (tests/bench/bench.py --threshold; docs/performance.md).
SHM_THRESHOLD = 128 << 10
# A wait for a reply polls the socket this long before it sleeps (adaptive;
# libtorchloop's TL_BUSY_POLL_US_DEFAULT; docs/python.md, the Client section)
BUSY_POLL_US = 50
_LENGTH = struct.Struct(">I")
_FIRST_ID = 1 << 16
# A daemon restart (systemd's restart, an upgrade) takes seconds: a request
# whose connection broke unanswered waits this long for it (Client.call).
RECONNECT_S = 30.0
# Requests the daemon may run twice with the same effect: sent again after an
# unanswered loss.  Not unregister, shutdown, attach (a new connection
# attaches its own region).
_RETRIED = frozenset({"hello", "health", "list", "describe", "stats", "register", "compile",
                      "scan", "grad"})


def _ref_bytes(tree: Any, threshold: int) -> int:
    """Bytes of the tensors in tree that would travel by reference."""
    if isinstance(tree, torch.Tensor):
        n = tree.numel() * tree.element_size()
        return n if n >= threshold else 0
    if isinstance(tree, (list, tuple)):
        return sum(_ref_bytes(t, threshold) for t in tree)
    if isinstance(tree, dict):
        return sum(_ref_bytes(t, threshold) for t in tree.values())
    return 0


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

    def __init__(self, socket: str | None = None, timeout: float | None = None, *,
                 shm: int | None = None, shm_threshold: int = SHM_THRESHOLD,
                 busy_poll_us: int | None = None, reconnect: float = RECONNECT_S,
                 stage_cache: bool | None = None) -> None:
        self.path = socket or default_socket()
        self.timeout = timeout
        self.reconnect = float(reconnect)
        # requests sent again after an unanswered loss or SHUTTING_DOWN
        # (call(); libtorchloop's tl_resent)
        self.resends: int = 0
        if busy_poll_us is None:
            busy_poll_us = int(os.environ.get("TORCHLOOP_BUSY_POLL_US") or BUSY_POLL_US)
        # one CPU: the poller would hold the daemon off it
        self.busy_poll_us = busy_poll_us if len(os.sched_getaffinity(0)) > 1 else 0
        self._sock: _socket.socket | None = None
        self._pid = 0
        # request ids count from 2**16 so that each is a 5-byte uint32 in a
        # frame: replies of one shape then differ only in data and id payload
        # (what _wire.Replies relies on to reuse a layout)
        self._next_id = _FIRST_ID - 1
        self._lock = threading.Lock()
        self.on_event: Callable[[dict], None] | None = None
        self.shm_size = SHM_DEFAULT if shm is None else int(shm)
        self.shm_threshold = max(1, int(shm_threshold))
        # a tensor staged in the region is sent again without a copy while
        # unchanged (_shm.Staged); False: copied at every request
        if stage_cache is None:
            stage_cache = os.environ.get("TORCHLOOP_STAGE_CACHE", "1") != "0"
        self.stage_cache = stage_cache
        self.shm_error: Exception | None = None  # why shared memory is off, if it failed
        self._region: Region | None = None
        self._hints: dict[tuple[str, str, bool], int] = {}
        # replies are read through this buffer: a header and a small body in
        # one recv; larger bodies go straight into their own buffer
        self._stage = bytearray(16384)
        self._staged = memoryview(b"")
        self._replies = _wire.Replies()
        # with the C codec, frames are read (and small requests' whole round
        # trips made) by _fast.Conn on the socket's descriptor, through its
        # own staging buffer; _stage and _staged serve _wire.py alone
        self._conn: Any = None

    # ---- the connection -------------------------------------------------

    def _connect(self) -> _socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            return self._sock
        self._sock = None  # a fork's copy of the parent's socket is never used
        self._region = None  # nor its region: it belongs to that connection
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise ConnectionLost("IO", f"cannot connect to torchloopd at {self.path}: {exc}") from exc
        self._sock, self._pid = sock, os.getpid()
        self._staged = memoryview(b"")
        self._conn = None
        if _wire.fast is not None:
            ms = -1 if self.timeout is None else max(0, round(self.timeout * 1000))
            self._conn = _wire.fast.Conn(sock.fileno(), ms, ConnectionLost, self.busy_poll_us)
        self._hello()
        return sock

    def _hello(self) -> None:
        reply = self._roundtrip("hello", {"protocol": PROTOCOL})
        if reply.get("protocol") != PROTOCOL:
            raise TorchloopError("VERSION_MISMATCH", f"daemon speaks protocol {reply.get('protocol')}")
        torch_version = reply.get("torch")  # what its graphs are built by (local runs)
        self.daemon_torch = torch_version if isinstance(torch_version, str) else None

    def close(self) -> None:
        if self._sock is not None and self._pid == os.getpid():
            self._sock.close()
        self._sock = None
        self._conn = None
        self._region = None  # results still viewing it keep the mapping alive

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- frames ---------------------------------------------------------

    def _send(self, buffers: list[Any], fd: int | None = None) -> None:
        """Writes the frame's buffers: one sendmsg in the usual case, more
        after a short write (a socket with a timeout, a signal)."""
        sock = self._sock
        assert sock is not None
        anc = []
        if fd is not None:  # rides on the frame's first bytes
            anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack("i", fd))]
        views = buffers  # bytes and byte-format memoryviews: len() is their size
        total = sum(map(len, buffers))
        while True:
            try:
                sent = sock.sendmsg(views, anc)
            except OSError as exc:
                self._drop()
                raise unanswered(ConnectionLost("IO", f"write to torchloopd: {exc}")) from exc
            if sent == total:
                return
            total -= sent
            anc = []
            views = [memoryview(b).cast("B") for b in views]
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if not views:
                return
            if sent:
                views[0] = views[0][sent:]

    def _recv_some(self, buf: memoryview, in_frame: bool = False) -> int:
        """One recv_into buf: at least one byte, or ConnectionLost (its code
        FRAME_TRUNCATED when the stream ends inside a reply frame)."""
        sock = self._sock
        assert sock is not None
        try:
            n = sock.recv_into(buf)
        except OSError as exc:
            self._drop()
            raise ConnectionLost("IO", f"read from torchloopd: {exc}") from exc
        if n == 0:
            self._drop()
            if in_frame:
                raise ConnectionLost("FRAME_TRUNCATED",
                                     "torchloopd closed the connection inside a reply frame")
            raise ConnectionLost("IO", "torchloopd closed the connection")
        return n

    def _read_exact(self, buf: memoryview) -> None:
        """Fills buf from the staging buffer, then the socket (large bodies in place)."""
        got = 0
        while got < len(buf):
            if self._staged.nbytes:
                k = min(self._staged.nbytes, len(buf) - got)
                buf[got:got + k] = self._staged[:k]
                self._staged = self._staged[k:]
                got += k
            elif len(buf) - got >= len(self._stage):
                got += self._recv_some(buf[got:], in_frame=True)
            else:
                n = self._recv_some(memoryview(self._stage), in_frame=True)
                self._staged = memoryview(self._stage)[:n]

    def _recv(self, area: Any = None) -> dict:
        if self._conn is not None:
            try:
                body = self._conn.recv_body()
            except BaseException:  # lost, or a signal handler's exception mid-frame:
                self._drop()  # where the next frame starts is unknown
                raise
            return self._decode(body, area)
        staged = self._staged
        if not staged.nbytes:  # between frames: a loss here left no reply half read
            try:
                n = self._recv_some(memoryview(self._stage))
            except ConnectionLost as exc:
                raise unanswered(exc) from exc.__cause__
            staged = memoryview(self._stage)[:n]
            self._staged = staged
        if staged.nbytes >= 4:  # the usual case: the whole frame came in one recv
            (length,) = _LENGTH.unpack_from(staged)
            if 4 + length <= staged.nbytes:
                body = bytearray(staged[4:4 + length])
                self._staged = staged[4 + length:]
                return self._decode(body, area)
        head = bytearray(4)
        self._read_exact(memoryview(head))
        (length,) = struct.unpack(">I", head)
        if length > _wire.FRAME_MAX:
            self._drop()
            raise ConnectionLost("FRAME_TOO_LARGE", f"reply of {length} bytes")
        body = bytearray(length)
        self._read_exact(memoryview(body))
        return self._decode(body, area)

    def _decode(self, body: bytearray, area: Any) -> dict:
        msg = None
        if area is None and _wire.fast is not None:
            msg = _wire.fast.decode(body)
        if msg is None:
            msg = self._replies.decode(body, area)
        if not isinstance(msg, dict):
            raise TorchloopError("MSGPACK_INVALID", "reply is not a map")
        return msg

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._conn = None
        self._region = None
        self._staged = memoryview(b"")

    def _roundtrip(self, op: str, fields: dict[str, Any], *, place: Any = None,
                   area: Any = None, fd: int | None = None) -> dict:
        """One request encoded by _wire.py (place: where a tensor lies in the
        region; area: the output area; fd: a descriptor passed with it)."""
        rid = self._new_id()
        enc = _wire.Encoder(place)
        enc.value({"id": rid, "op": op, **fields})
        return self._exchange(enc.frame(), rid, area, fd)

    def _conn_call(self, rid: int, op: str, fields: dict[str, Any], limit: int,
                   place: Callable[[torch.Tensor], int | None] | None = None,
                   area: Area | None = None) -> dict | None:
        """The round trip in C (_fast.Conn.call): the result map, or None when
        the request needs _wire.py (nothing was sent).  With place, tensors
        of shm_threshold bytes or more go by reference into the region
        (place stages them), and references in the reply are views of area."""
        assert self._conn is not None
        try:
            out = self._conn.call(rid, op, fields, limit, self.on_event, place,
                                  self.shm_threshold, area)
        except BaseException:  # lost, or interrupted (Ctrl-C) with the reply
            self._drop()  # unread or half read: the next call connects again
            raise
        if out is None or type(out) is dict:
            return out
        return self._settle(rid, out, area)

    def _settle(self, rid: int, out: Any, area: Area | None = None) -> dict:
        """What Conn.call returned when it was not a result: an error reply
        (raised) or a body the C decoder left to _wire.py."""
        reply = out[0] if type(out) is tuple else self._decode(out, area)
        return self._reply(rid, area, reply)

    def _new_id(self) -> int:
        self._next_id = self._next_id + 1 if self._next_id < 0xFFFFFFFF else _FIRST_ID
        return self._next_id

    def _exchange(self, buffers: list[Any], rid: int, area: Any = None, fd: int | None = None) -> dict:
        """Sends one request's frame and reads frames up to its reply."""
        self._send(buffers, fd)
        return self._reply(rid, area, None)

    def _reply(self, rid: int, area: Any, reply: dict | None) -> dict:
        """Reads frames (after `reply`, when one is in hand) up to the reply
        to rid: its result map, or its error raised."""
        while True:
            if reply is None:
                reply = self._recv(area)
            if "event" in reply:
                if self.on_event is not None:
                    self.on_event(reply)
            elif reply.get("id") == rid:
                if "error" in reply:
                    raise from_reply(reply["error"])
                return reply.get("result", {})
            elif "error" in reply and reply.get("id") is None:
                raise from_reply(reply["error"])  # a frame-level error
            reply = None

    def call(self, op: str, **fields: Any) -> dict:
        """Sends one request and returns its result map (raises on an error reply).

        A request the daemon may run twice without harm (_RETRIED) whose
        connection broke before any byte of its reply arrived (a daemon
        restart: ConnectionLost.unanswered) is sent again, once, on a new
        connection, waiting up to `reconnect` seconds for the daemon to
        listen again; so is one a stopping daemon refused unrun
        (SHUTTING_DOWN).  `resends` counts the requests sent again."""
        return self._request(op, fields)

    def _request(self, op: str, fields: dict[str, Any]) -> dict:
        """call() over a fields map (the retry once, as call() says)."""
        try:
            return self._call(op, fields)
        except TorchloopError as exc:
            retry = exc.unanswered if isinstance(exc, ConnectionLost) else \
                exc.code == "SHUTTING_DOWN"  # refused unrun by a daemon going away
            if not retry or op not in _RETRIED or self.reconnect <= 0:
                raise
            self._reconnect(exc)
            with self._lock:
                self.resends += 1
            return self._call(op, fields)

    def _call(self, op: str, fields: dict[str, Any]) -> dict:
        """The one routing decision: in one C call (_fast.Conn.call) when the
        C codec is built and every tensor may travel inline; else, for a scan
        or grad with shared memory on, through the region (_shm_call, in C as
        well); else encoded by _wire.py."""
        with self._lock:
            if self._sock is None or self._pid != os.getpid():
                self._connect()
            limit = self._inline_limit(op, fields)
            if limit > 0:
                result = self._conn_call(self._new_id(), op, fields, limit)
                if result is not None:
                    return result  # else the C encoder handed it back: nothing was sent
            if op in ("scan", "grad") and self.shm_size > 0:
                return self._shm_call(op, fields)
            return self._roundtrip(op, fields)

    def _inline_limit(self, op: str, fields: dict[str, Any]) -> int:
        """The largest tensor (bytes) the C call may send inline; 0: do not
        try it (no C codec, or a scan that wants an output area)."""
        if self._conn is None:
            return 0
        if op in ("scan", "grad") and self.shm_size > 0:
            if self._hints.get(_hint_key(op, fields)):
                return 0  # it wants an output area in the region
            return min(_wire.FAST_LIMIT, self.shm_threshold - 1)
        return _wire.FAST_LIMIT

    def _reconnect(self, why: TorchloopError) -> None:
        """A new connection (a new region, attached on its first need), trying
        every 50 ms up to `reconnect` seconds while the daemon is not there."""
        deadline = time.monotonic() + self.reconnect
        with self._lock:
            self._drop()
            while True:
                try:
                    self._connect()
                    return
                except ConnectionLost as exc:
                    if time.monotonic() >= deadline:
                        raise exc from why
                time.sleep(0.05)

    # ---- shared memory ------------------------------------------------------

    def _attach(self, need: int) -> Region | None:
        """The connection's region, attached on first need (None: shm off)."""
        if self._region is not None:
            return self._region
        if self.shm_size <= 0 or need == 0:
            return None
        region = Region(max(self.shm_size, 4 * need))
        try:
            self._roundtrip("attach", {"size": region.size}, fd=region.fd)
        except TorchloopError as exc:
            if isinstance(exc, ConnectionLost):
                raise
            self.shm_error = exc  # e.g. SHM_TOO_LARGE: keep working inline
            self.shm_size = 0
            return None
        finally:
            region.close_fd()  # the daemon has its own mapping now
        self._region = region
        return region

    def _shm_call(self, op: str, fields: dict[str, Any]) -> dict:
        """A scan or grad whose large tensors go through the region (staged
        there unless they live in it already), with an output area for the
        results when the region has room."""
        threshold = self.shm_threshold
        key = _hint_key(op, fields)
        trees = [fields.get(k) for k in ("carry", "inputs", "params", "cot_carry", "cot_outputs",
                                         "saved")]
        need = sum(_ref_bytes(t, threshold) for t in trees)
        region = self._attach(need)
        if region is None:
            return self._roundtrip(op, fields)
        staged: list[int] = []

        def place(t: torch.Tensor) -> int | None:
            n = t.numel() * t.element_size()
            if n < threshold:
                return None
            off = region.offset_of(t)
            if off is None and self.stage_cache:
                off = region.staged.lookup(t)  # sent before, unchanged since
            if off is not None:
                return off
            off = region.alloc(n)
            if off is None:
                return None  # region full: this one goes inline
            region.put(off, t)
            if not (self.stage_cache and region.staged.keep(t, off)):
                staged.append(off)
            return off

        # until a reply says (out_needed): a guess, saved included
        size = self._hints.get(key, (2 if op == "grad" or key[2] else 1) * need)
        area_off = region.alloc(size) if size > 0 else None
        area = region.area(area_off) if area_off is not None else None
        if area is not None:
            fields = {**fields, "out": {"offset": area_off, "size": size, "min_bytes": threshold}}
        try:
            result = None
            if self._conn is not None:  # in C; None: _wire.py's (nothing was sent)
                # what place does not take is below the threshold: C copies it
                # in, so that only other types fall back (and stage again)
                limit = max(_wire.FAST_LIMIT, threshold - 1)
                result = self._conn_call(self._new_id(), op, fields, limit, place, area)
            if result is None:
                result = self._roundtrip(op, fields, place=place, area=area)
        finally:
            region.staged.done()
            for off in staged:
                region.free(off)
        if area is not None and result.get("out_needed", size) != size:
            self._hints[key] = int(result["out_needed"])
        return result

    def empty(self, shape: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A tensor in this connection's shared region (sent without a copy);
        an ordinary tensor when shared memory is off or the region is full."""
        shape = tuple(shape)
        with self._lock:
            self._connect()
            t = None
            region = self._attach(1)
            if region is not None:
                t = region.empty(shape, dtype)
            return t if t is not None else torch.empty(shape, dtype=dtype)

    # ---- ops --------------------------------------------------------------

    def health(self) -> dict:
        return self.call("health")

    def register(self, name: str, source: str, entry: str = "body", *,
                 body_file: str | None = None, max_steps: int | None = None,
                 max_elements: int | None = None, recompile_budget: int | None = None,
                 strategy: str | None = None, dynamic: str | None = None) -> dict:
        return self.call("register", **_given(
            name=name, body_source=source, entry=entry, body_file=body_file,
            max_steps=max_steps, max_elements=max_elements,
            recompile_budget=recompile_budget, strategy=strategy, dynamic=dynamic))

    def register_graph(self, name: str, graph: str, *, max_steps: int | None = None,
                       max_elements: int | None = None, recompile_budget: int | None = None,
                       strategy: str | None = None, dynamic: str | None = None) -> dict:
        """Registers a captured step graph (torchloop._graph's JSON text): any
        user allowed on the socket may; name must be "g." + its content's hash."""
        return self.call("register", **_given(
            name=name, body_graph=graph, max_steps=max_steps, max_elements=max_elements,
            recompile_budget=recompile_budget, strategy=strategy, dynamic=dynamic))

    def unregister(self, name: str) -> dict:
        return self.call("unregister", name=name)

    def describe(self, name: str) -> dict:
        return self.call("describe", name=name)

    def list(self) -> list[dict]:
        return self.call("list")["adapters"]

    def stats(self) -> dict:
        return self.call("stats")

    def scan(self, adapter: str, carry: Any, inputs: Any, params: Any = None) -> tuple[Any, Any]:
        """(final carry, stacked outputs) for one scan; trees keep their structure.
        params: tensors every step reads unchanged; the body gets the carry
        (carry, params) and returns params as it got them; they are not sent
        back (docs/protocol.md, `scan`)."""
        fields = {"adapter": adapter, "carry": carry, "inputs": inputs}
        if params is not None:
            fields["params"] = params
        res = self._request("scan", fields)
        return res["carry"], res["outputs"]

    def grad(self, adapter: str, carry: Any, inputs: Any, cot_carry: Any = None,
             cot_outputs: Any = None, params: Any = None, checkpoint: bool = False) -> dict:
        """The scan and its vector-Jacobian product: keys carry, outputs, grad_carry,
        grad_inputs (and grad_params with params).  checkpoint: the graph that
        keeps each step's carry and recomputes the step (its own compile)."""
        fields = {"adapter": adapter, "carry": carry, "inputs": inputs, "cot_carry": cot_carry,
                  "cot_outputs": cot_outputs}
        if params is not None:
            fields["params"] = params
        if checkpoint:
            fields["checkpoint"] = True
        return self._request("grad", fields)


def _hint_key(op: str, fields: dict[str, Any]) -> tuple[str, str, bool]:
    """What an output area's size is remembered by: a scan with save and a
    grad with saved return other results than the plain ones."""
    return str(fields.get("adapter")), op, "save" in fields or "saved" in fields


def _given(**fields: Any) -> dict[str, Any]:
    """The fields that have a value (the daemon's defaults for the others)."""
    return {k: v for k, v in fields.items() if v is not None}

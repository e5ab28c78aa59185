"""Test helper: a minimal torchloopd wire client in Python (numpy trees).

Independent of the C code under test: it encodes trees by docs/protocol.md.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import numpy as np

EXT_TENSOR, EXT_TUPLE = 1, 2
DTYPES = {np.dtype("float32"): 1, np.dtype("float64"): 2}
CODES = {1: np.float32, 2: np.float64}


def encode_tree(tree: Any) -> Any:
    if tree is None:
        return None
    if isinstance(tree, np.ndarray):
        a = np.ascontiguousarray(tree)
        meta = bytes([DTYPES[a.dtype], a.ndim, 0, 0]) + b"".join(
            struct.pack("<q", d) for d in a.shape
        )
        return msgpack.ExtType(EXT_TENSOR, meta + a.astype(a.dtype.newbyteorder("<")).tobytes())
    if isinstance(tree, tuple):
        return [msgpack.ExtType(EXT_TUPLE, b"")] + [encode_tree(v) for v in tree]
    if isinstance(tree, list):
        return [encode_tree(v) for v in tree]
    if isinstance(tree, dict):
        return {k: encode_tree(v) for k, v in tree.items()}
    raise TypeError(type(tree))


def decode_tree(obj: Any) -> Any:
    if obj is None:
        return None
    if isinstance(obj, msgpack.ExtType):
        assert obj.code == EXT_TENSOR
        d = obj.data
        dtype, ndim, pad = d[0], d[1], d[2]
        shape = struct.unpack_from(f"<{ndim}q", d, 4)
        start = 4 + 8 * ndim + pad
        return np.frombuffer(d[start:], dtype=np.dtype(CODES[dtype]).newbyteorder("<")).reshape(shape)
    if isinstance(obj, list):
        if obj and isinstance(obj[0], msgpack.ExtType) and obj[0].code == EXT_TUPLE:
            return tuple(decode_tree(v) for v in obj[1:])
        return [decode_tree(v) for v in obj]
    if isinstance(obj, dict):
        return {k: decode_tree(v) for k, v in obj.items()}
    raise TypeError(type(obj))


class Client:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def send_raw(self, body: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def recv(self) -> dict[str, Any]:
        head = self._read(4)
        (n,) = struct.unpack(">I", head)
        return msgpack.unpackb(self._read(n), raw=False, strict_map_key=False)

    def _read(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("daemon closed the connection")
            buf += chunk
        return buf

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.next_id += 1
        msg = {"id": self.next_id, "op": op}
        for k, v in fields.items():
            msg[k] = encode_tree(v) if k in ("carry", "inputs", "cot_carry", "cot_outputs") else v
        self.send_raw(msgpack.packb(msg, use_bin_type=True))
        while True:
            reply = self.recv()
            if "event" in reply:
                self.events.append(reply)
                continue
            assert reply["id"] == self.next_id, reply
            if "result" in reply:
                res = reply["result"]
                for k in ("carry", "outputs", "grad_carry", "grad_inputs"):
                    if k in res:
                        res[k] = decode_tree(res[k])
            return reply

"""The daemon's framing on the worker's stdin/stdout: a 4-byte big-endian
length, then one msgpack map.  stderr is the worker's log."""

from __future__ import annotations

import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise EOFError("truncated frame header")
    (length,) = struct.unpack(">I", head)
    body = stream.read(length)
    if len(body) < length:
        raise EOFError("truncated frame body")
    msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(msg, dict):
        raise ValueError("frame is not a map")
    return msg


def write_frame(stream: BinaryIO, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def log(msg: str) -> None:
    print(f"worker[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)



"""The daemon's framing on the worker's stdin/stdout: a 4-byte big-endian
length, then one msgpack map.  stderr is the worker's log."""

from __future__ import annotations

import os
import struct
import sys
from typing import Any, BinaryIO

import msgpack

class BadText(ValueError):
    """A whole frame whose strings are not all UTF-8: answered, never fatal
    (the daemon refuses such text first; this is the second wall)."""

    def __init__(self, rid: object, field: str) -> None:
        super().__init__(f"job field {field!r} is not well-formed UTF-8")
        self.rid, self.field = rid, field


def bad_text(body: bytes) -> BadText:
    """The id and the first field of an undecodable (but well-framed) body."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=False,
                              unicode_errors="surrogateescape")
    except Exception:  # noqa: BLE001 - not a map at all: no id to answer
        return BadText(None, "?")
    if not isinstance(msg, dict):
        return BadText(None, "?")
    rid = msg.get("id")
    for key, value in msg.items():
        if not readable(key) or not readable(value):
            return BadText(rid, str(key).encode("utf-8", "backslashreplace").decode())
    return BadText(rid, "?")


def readable(value: object) -> bool:
    """Holds no surrogate-escaped byte at any depth."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, (list, tuple)):
        return all(readable(v) for v in value)
    if isinstance(value, dict):
        return all(readable(k) and readable(v) for k, v in value.items())
    return True


def read_frame(stream: BinaryIO) -> dict[str, Any] | None:
    """One request; EOFError when the stream is cut (fatal), BadText when a
    well-framed body holds text that is not UTF-8 (answered)."""
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise EOFError("truncated frame header")
    (length,) = struct.unpack(">I", head)
    body = stream.read(length)
    if len(body) < length:
        raise EOFError("truncated frame body")
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except UnicodeDecodeError:
        raise bad_text(body) from None
    if not isinstance(msg, dict):
        raise ValueError("frame is not a map")
    return msg


def write_frame(stream: BinaryIO, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def escape(text: str) -> str:
    """Control characters and backslashes as \\xNN (the daemon's log.c does the
    same): one call, one line, whatever the text holds."""
    return "".join(f"\\x{ord(ch):02x}" if ch < " " or ch in "\x7f\\" or "\x80" <= ch <= "\x9f"
                   else ch for ch in text)


def log(msg: str) -> None:
    """One line on stderr (a traceback too: its newlines escaped); the daemon
    relays it into its log, quoted."""
    print(f"worker[{os.getpid()}]: {escape(msg.rstrip(chr(10)))}", file=sys.stderr, flush=True)



"""The torchloopd wire format (docs/protocol.md), for torch tensors.

A frame is a 4-byte big-endian length and one msgpack map.  Tensors are
ext32 type 1: dtype (1 = float32, 2 = float64), ndim, pad, a reserved byte,
ndim little-endian int64 dims, pad zero bytes, then the data.  Tuples are
arrays led by an empty ext type 2.

The encoder is written here rather than taken from the msgpack package so
that it can (1) pad each tensor so its data lands 64-byte aligned in the
daemon's frame buffer (which then wraps it without a copy) and (2) send the
tensors' memory by reference (sendmsg over a list of buffers).  The decoder
reads a reply frame into one bytearray and returns tensors that are views
into it (torch.frombuffer), so reply data is not copied either.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import torch

EXT_TENSOR, EXT_TUPLE, EXT_SHM = 1, 2, 3
ALIGN = 64
FRAME_MAX = 1 << 30
SMALL = 4096  # tensors of at most this many bytes are copied into the frame
DTYPE_CODES = {torch.float32: 1, torch.float64: 2}
CODE_DTYPES = {1: torch.float32, 2: torch.float64}

if sys.byteorder != "little":  # pragma: no cover - the daemon is x86-64/arm64 Linux
    raise ImportError("torchloop's wire format is little-endian; this host is not")


_EXT32_TENSOR = struct.Struct(">BIBBBBB")  # 0xc9, length, type 1, dtype, ndim, pad, 0
_EXT32_SHM = struct.Struct(">BIBBB6x")  # 0xc9, length, type 3, dtype, ndim, 6 zero bytes
_DIMS = [struct.Struct(f"<{n}q") for n in range(33)]  # the daemon allows 8 dims
_ZEROS = bytes(ALIGN)
_STR_CACHE: dict[str, bytes] = {}  # keys and op names: encoded once


def _str_bytes(s: str) -> bytes:
    b = _STR_CACHE.get(s)
    if b is None:
        raw = s.encode()
        n = len(raw)
        b = (bytes((0xA0 | n,)) if n < 32 else b"\xdb" + struct.pack(">I", n)) + raw
        if n < 64 and len(_STR_CACHE) < 4096:
            _STR_CACHE[s] = b
    return b


class Encoder:
    """Builds one frame as a list of buffers (small bytes + tensor memory).

    place(t), when given, may return a region offset for a tensor: it is then
    sent as a shared-memory reference (ext type 3) instead of its bytes.

    The body's small bytes accumulate in one bytearray; a tensor above SMALL
    bytes ends it and goes out as a view of its own memory.  `flushed` counts
    the bytes of the buffers already ended.
    """

    def __init__(self, place: Any = None) -> None:
        self.place = place
        self.parts: list[Any] = []
        self.small = bytearray()
        self.flushed = 0
        self.keep: list[Any] = []  # what the referenced memory belongs to

    @property
    def size(self) -> int:
        """Body bytes so far (the 4-byte length is not counted)."""
        return self.flushed + len(self.small)

    def _ref(self, view: memoryview) -> None:
        if self.small:
            self.parts.append(bytes(self.small))
            self.flushed += len(self.small)
            self.small = bytearray()
        self.parts.append(view)
        self.flushed += view.nbytes

    def value(self, v: Any) -> None:  # noqa: C901 - one branch per type
        t = type(v)
        if t is dict:
            self._map_header(len(v))
            for key, item in v.items():
                if type(key) is not str:
                    raise TypeError(f"dict keys must be strings, got {type(key).__name__}")
                self.small += _str_bytes(key)
                self.value(item)
        elif t is torch.Tensor or isinstance(v, torch.Tensor):
            self.tensor(v)
        elif t is str:
            self.small += _str_bytes(v)
        elif v is None:
            self.small.append(0xC0)
        elif v is True or v is False:
            self.small.append(0xC3 if v else 0xC2)
        elif isinstance(v, int):
            self._int(v)
        elif isinstance(v, float):
            self.small += b"\xcb" + struct.pack(">d", v)
        elif isinstance(v, str):
            self.small += _str_bytes(str(v))
        elif isinstance(v, tuple):
            self._array_header(len(v) + 1)
            self.small += b"\xc7\x00" + bytes((EXT_TUPLE,))  # ext8, length 0
            for item in v:
                self.value(item)
        elif isinstance(v, list):
            self._array_header(len(v))
            for item in v:
                self.value(item)
        elif isinstance(v, dict):
            self.value(dict(v))
        else:
            raise TypeError(f"cannot send a {type(v).__name__}")

    def _int(self, v: int) -> None:
        if 0 <= v < 128:
            self.small.append(v)
        elif 0 <= v < 1 << 32:
            self.small += b"\xce" + struct.pack(">I", v)
        elif 0 <= v < 1 << 64:
            self.small += b"\xcf" + struct.pack(">Q", v)
        elif -(1 << 63) <= v < 0:
            self.small += b"\xd3" + struct.pack(">q", v)
        else:
            raise OverflowError(f"integer {v} does not fit 64 bits")

    def _array_header(self, n: int) -> None:
        self.small += bytes((0x90 | n,)) if n < 16 else b"\xdd" + struct.pack(">I", n)

    def _map_header(self, n: int) -> None:
        self.small += bytes((0x80 | n,)) if n < 16 else b"\xdf" + struct.pack(">I", n)

    def tensor(self, t: torch.Tensor) -> None:
        code = DTYPE_CODES.get(t.dtype)
        if code is None:
            raise TypeError(f"tensors must be float32 or float64, got {t.dtype}")
        if not t.is_cpu:
            raise TypeError(f"tensors must be on the CPU, got {t.device}")
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        shape = t.shape
        ndim = len(shape)
        dims = _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}q")
        nbytes = t.nbytes
        small = self.small
        if self.place is not None:
            off = self.place(t)
            if off is not None:
                small += _EXT32_SHM.pack(0xC9, 24 + 8 * ndim, EXT_SHM, code, ndim)
                small += struct.pack("<QQ", off, nbytes)
                small += dims.pack(*shape)
                return
        head = 4 + 8 * ndim
        # ext32 marker (1) + length (4) + type (1), then the header: pad so
        # that the data starts at a multiple of 64 from the body's start
        pad = (-(self.flushed + len(small) + 6 + head)) % ALIGN
        small += _EXT32_TENSOR.pack(0xC9, head + pad + nbytes, EXT_TENSOR, code, ndim, pad, 0)
        small += dims.pack(*shape)
        small += _ZEROS[:pad]
        if nbytes <= SMALL:  # copied in with the header: one buffer, no reference
            if nbytes:
                small += t.numpy().tobytes()
        else:
            self.keep.append(t)
            self._ref(memoryview(t.numpy()).cast("B"))

    def frame(self) -> list[Any]:
        """The frame's buffers, length prefix first."""
        size = self.size
        if self.small:
            self.parts.append(bytes(self.small))
            self.flushed += len(self.small)
            self.small = bytearray()
        if size > FRAME_MAX:
            raise ValueError(f"request of {size} bytes exceeds the 1 GiB frame limit")
        return [struct.pack(">I", size)] + self.parts


_SIMPLE = {0xC0: None, 0xC2: False, 0xC3: True}
_FIXED = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
          0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
_BIN = {0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}
_STR = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I"}
_EXT = {0xC7: ">B", 0xC8: ">H"}
_STRUCTS = {f: struct.Struct(f) for f in (">B", ">H", ">I", ">Q", ">b", ">h", ">i", ">q", ">f", ">d")}


class _TupleMarker:
    pass


TUPLE_MARKER = _TupleMarker()


class Decoder:
    """Parses one reply body (a bytearray); tensors are views into it, or,
    for shared-memory references, views into the request's output area."""

    def __init__(self, body: bytearray, area: Any = None) -> None:
        self.area = area
        self.body = body
        self.view = memoryview(body)
        self.pos = 0

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.body):
            raise ValueError("truncated msgpack in a reply")
        v = self.view[self.pos : self.pos + n]
        self.pos += n
        return v

    def _u(self, fmt: str) -> int:
        st = _STRUCTS[fmt]
        (v,) = st.unpack_from(self.body, self.pos)
        self.pos += st.size
        return v

    def value(self) -> Any:  # noqa: C901 - one branch per msgpack type byte
        b = self.body[self.pos]
        self.pos += 1
        if b <= 0x7F:
            return b
        if b <= 0x8F:
            return self._map(b & 0x0F)
        if b <= 0x9F:
            return self._array(b & 0x0F)
        if b <= 0xBF:
            return str(self._take(b & 0x1F), "utf-8")
        if b == 0xC9:  # ext32: tensors
            n = self._u(">I")
            return self._ext(self._u(">b"), n)
        if b >= 0xE0:
            return b - 0x100
        if b in _SIMPLE:
            return _SIMPLE[b]
        if b in _FIXED:
            return self._u(_FIXED[b])
        if b in _BIN:
            return bytes(self._take(self._u(_BIN[b])))
        if b in _STR:
            return str(self._take(self._u(_STR[b])), "utf-8")
        if b in _EXT:
            n = self._u(_EXT[b])
            return self._ext(self._u(">b"), n)
        if 0xD4 <= b <= 0xD8:  # fixext
            return self._ext(self._u(">b"), 1 << (b - 0xD4))
        if b in (0xDC, 0xDD):
            return self._array(self._u(">H" if b == 0xDC else ">I"))
        if b in (0xDE, 0xDF):
            return self._map(self._u(">H" if b == 0xDE else ">I"))
        raise ValueError(f"msgpack type byte 0x{b:02x} in a reply")

    def _array(self, n: int) -> Any:
        items = [self.value() for _ in range(n)]
        if items and items[0] is TUPLE_MARKER:
            return tuple(items[1:])
        return items

    def _map(self, n: int) -> dict:
        out = {}
        for _ in range(n):
            key = self.value()
            out[key] = self.value()
        return out

    def _ext(self, code: int, n: int) -> Any:
        start = self.pos
        self.pos += n
        if code == EXT_TUPLE:
            return TUPLE_MARKER
        if code == EXT_SHM:
            if self.area is None or n < 24:
                raise ValueError("a shared-memory reference in a reply without an output area")
            dtype_code, ndim = self.body[start], self.body[start + 1]
            off, nbytes = struct.unpack_from("<QQ", self.body, start + 8)
            shape = struct.unpack_from(f"<{ndim}q", self.body, start + 24)
            return self.area.tensor(off, CODE_DTYPES[dtype_code], shape, nbytes)
        if code != EXT_TENSOR:
            raise ValueError(f"unknown ext type {code} in a reply")
        dtype_code, ndim, pad = self.body[start], self.body[start + 1], self.body[start + 2]
        dtype = CODE_DTYPES[dtype_code]
        dims = _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}q")
        shape = dims.unpack_from(self.body, start + 4)
        data = start + 4 + 8 * ndim + pad
        numel = 1
        for d in shape:
            numel *= d
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(self.body, dtype=dtype, count=numel, offset=data)
        return t if ndim == 1 else t.view(shape)


def decode(body: bytearray, area: Any = None) -> Any:
    return Decoder(body, area).value()

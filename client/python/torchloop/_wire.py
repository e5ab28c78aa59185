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
into it (numpy arrays over it, wrapped by torch.from_numpy), so reply data is
not copied either.  _fast.c, when built, does the common case of both in C.
"""

from __future__ import annotations

import struct
import sys
from ctypes import string_at as _string_at
from typing import Any

import numpy as np
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
_HEADERS: dict[tuple, bytes] = {}  # (dtype code, shape, offset % 64) -> tensor ext header


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
        if t.layout is not torch.strided:
            raise TypeError(f"tensors must be dense (strided), got {t.layout}")
        shape = t.shape
        nbytes = t.nbytes
        small = self.small
        if self.place is not None:
            off = self.place(t)  # the caller's own tensor: a copy kept is keyed on it
            if off is not None:
                ndim = len(shape)
                dims = _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}q")
                small += _EXT32_SHM.pack(0xC9, 24 + 8 * ndim, EXT_SHM, code, ndim)
                small += struct.pack("<QQ", off, nbytes)
                small += dims.pack(*shape)
                return
        if t.requires_grad:
            t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        # ext32 marker (1) + length (4) + type (1), then the header: pad so
        # that the data starts at a multiple of 64 from the body's start
        key = (code, shape, (self.flushed + len(small)) % ALIGN)
        header = _HEADERS.get(key)
        if header is None:
            ndim = len(shape)
            dims = _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}q")
            head = 4 + 8 * ndim
            pad = (-(key[2] + 6 + head)) % ALIGN
            header = (_EXT32_TENSOR.pack(0xC9, head + pad + nbytes, EXT_TENSOR, code, ndim, pad, 0)
                      + dims.pack(*shape) + _ZEROS[:pad])
            if len(_HEADERS) >= 4096:
                _HEADERS.clear()
            _HEADERS[key] = header
        small += header
        if nbytes <= SMALL:  # copied in with the header: one buffer, no reference
            if nbytes:  # a contiguous CPU tensor's bytes, read at its data pointer
                small += _string_at(t.data_ptr(), nbytes)
        else:
            self.keep.append(t)
            self._ref(t.numpy().data.cast("B"))

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
        if self.pos + st.size > len(self.body):
            raise ValueError("truncated msgpack in a reply")
        (v,) = st.unpack_from(self.body, self.pos)
        self.pos += st.size
        return v

    def value(self) -> Any:  # noqa: C901 - one branch per msgpack type byte
        if self.pos >= len(self.body):
            raise ValueError("truncated msgpack in a reply")
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
        if n > len(self.body) - self.pos:  # each item takes a byte at least
            raise ValueError("truncated msgpack in a reply")
        items = [self.value() for _ in range(n)]
        if items and items[0] is TUPLE_MARKER:
            return tuple(items[1:])
        return items

    def _map(self, n: int) -> dict:
        if 2 * n > len(self.body) - self.pos:
            raise ValueError("truncated msgpack in a reply")
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
        if data + numel * dtype.itemsize > start + n:
            raise ValueError("a tensor's data overruns its ext in a reply")
        return self._tensor(dtype, shape, data)

    def _tensor(self, dtype: torch.dtype, shape: tuple, data: int) -> torch.Tensor:
        return _leaf(self.body, dtype, shape, data)


_NP_DTYPES: dict[torch.dtype, np.dtype] = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def _leaf(body: bytearray, dtype: torch.dtype, shape: tuple, data: int) -> torch.Tensor:
    """A tensor viewing body's bytes at data (a fresh empty one if it has no elements)."""
    if 0 in shape:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.ndarray(shape, _NP_DTYPES[dtype], body, data))


def decode(body: bytearray, area: Any = None) -> Any:
    return Decoder(body, area).value()


# The C codec (_fast.c), when it was built: encode/decode of the common case,
# None for anything it leaves to the code above.
try:
    from . import _fast
except ImportError:  # pragma: no cover - no C compiler when the package was installed
    fast = None
else:
    _fast.setup(torch.Tensor, torch.float32, torch.float64, torch.strided, torch.from_numpy,
                torch.empty, np.ndarray, _NP_DTYPES[torch.float32], _NP_DTYPES[torch.float64])
    fast = _fast
FAST_LIMIT = 64 << 10  # the largest tensor _fast copies into a frame


# ---- replies of a shape seen before ------------------------------------------
#
# A solver sends the same scan again and again, and each reply differs from the
# last only in its tensors' bytes and its id.  Replies decides that from a
# comparison of every other byte (the structure: a msgpack stream parses the
# same way when its non-data bytes are the same) and then only makes the
# tensors, skipping the parse.


class _Slot:
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class _Recorder(Decoder):
    """A Decoder that notes where the tensors' data and the top-level id are."""

    def __init__(self, body: bytearray, area: Any) -> None:
        super().__init__(body, area)
        self.leaves: list[tuple[torch.dtype, tuple, int]] = []
        self.holes: list[tuple[int, int]] = []  # bytes not compared: data, id payload
        self.id_span: tuple[int, int] | None = None
        self.cacheable = True
        self.top = True

    def _map(self, n: int) -> dict:
        top, self.top = self.top, False
        out = {}
        for _ in range(n):
            key = self.value()
            at = self.pos
            out[key] = self.value()
            # an unsigned int of fixed width: its marker byte is compared, its payload is not
            if top and key == "id" and self.body[at] in (0xCC, 0xCD, 0xCE, 0xCF):
                self.id_span = (at + 1, self.pos)
                self.holes.append(self.id_span)
        return out

    def _array(self, n: int) -> Any:
        self.top = False
        return super()._array(n)

    def _ext(self, code: int, n: int) -> Any:
        if code == EXT_SHM:
            self.cacheable = False  # the area's offsets are the client's to check each time
        return super()._ext(code, n)

    def _tensor(self, dtype: torch.dtype, shape: tuple, data: int) -> Any:
        self.leaves.append((dtype, shape, data))
        numel = 1
        for d in shape:
            numel *= d
        if numel:
            self.holes.append((data, data + numel * dtype.itemsize))
        return _Slot(len(self.leaves) - 1)


def _build(tmpl: Any, leaves: list) -> Any:
    t = type(tmpl)
    if t is _Slot:
        return leaves[tmpl.i]
    if t is dict:
        return {k: _build(v, leaves) for k, v in tmpl.items()}
    if t is list:
        return [_build(v, leaves) for v in tmpl]
    if t is tuple:
        return tuple(_build(v, leaves) for v in tmpl)
    return tmpl  # scalars, strings, bytes, None: immutable, shared between replies


class _Layout:
    __slots__ = ("segs", "leaves", "template", "id_span")

    def __init__(self, rec: _Recorder, template: Any, size: int) -> None:
        self.leaves = rec.leaves
        self.template = template
        self.id_span = rec.id_span
        self.segs = []
        at = 0
        for a, b in sorted(rec.holes):
            if a > at:
                self.segs.append((at, a, bytes(rec.body[at:a])))
            at = b
        if at < size:
            self.segs.append((at, size, bytes(rec.body[at:size])))


class Replies:
    """Decodes reply bodies, remembering the layout of the last few shapes."""

    CAP = 64

    def __init__(self) -> None:
        self.layouts: dict[int, _Layout] = {}
        self.hits = 0

    def decode(self, body: bytearray, area: Any = None) -> Any:
        lay = self.layouts.get(len(body))
        if lay is not None:
            view = memoryview(body)
            for a, b, seg in lay.segs:
                if view[a:b] != seg:
                    break
            else:
                self.hits += 1
                msg = _build(lay.template, [_leaf(body, *leaf) for leaf in lay.leaves])
                if lay.id_span is not None:
                    a, b = lay.id_span
                    msg["id"] = int.from_bytes(view[a:b], "big")
                return msg
        rec = _Recorder(body, area)
        template = rec.value()
        msg = _build(template, [_leaf(body, *leaf) for leaf in rec.leaves])
        if rec.cacheable and rec.leaves and type(msg) is dict and rec.pos == len(body):
            if len(self.layouts) >= self.CAP:
                self.layouts.clear()
            self.layouts[len(body)] = _Layout(rec, template, len(body))
        return msg

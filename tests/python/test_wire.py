"""The Python client's hand-written msgpack codec (torchloop._wire) against an
independent one, the `msgpack` package: every frame the encoder builds must
parse there to the same values, every message msgpack builds must decode here
to the same values.  Tensors are laid out as docs/protocol.md says (ext 1:
dtype, ndim, pad, 0, little-endian dims, data 64-byte aligned in the body);
the expected bytes below are written from that text, not from the encoder."""

from __future__ import annotations

import struct

import msgpack
import pytest
import torch

from torchloop import _wire

DT = {1: torch.float32, 2: torch.float64}


def _body(frame: list) -> bytes:
    raw = b"".join(bytes(memoryview(b).cast("B")) for b in frame)
    (length,) = struct.unpack(">I", raw[:4])
    assert length == len(raw) - 4
    return raw[4:]


def _unpack(body: bytes):
    """msgpack's reading of a request body; tensors become (dtype, shape, data offset, bytes)."""
    offsets: list[int] = []

    def hook(code: int, data: bytes):
        if code == _wire.EXT_TUPLE:
            assert data == b""
            return "TUPLE"
        assert code == _wire.EXT_TENSOR
        dtype, ndim, pad, zero = data[0], data[1], data[2], data[3]
        assert zero == 0 and pad < 64
        shape = struct.unpack_from(f"<{ndim}q", data, 4)
        head = 4 + 8 * ndim
        assert data[head:head + pad] == bytes(pad)
        payload = data[head + pad:]
        start = body.find(payload) if payload else -1
        offsets.append(start)
        return ("T", DT[dtype], shape, payload)

    def tuples(v):
        if isinstance(v, list):
            if v and v[0] == "TUPLE":
                return tuple(tuples(x) for x in v[1:])
            return [tuples(x) for x in v]
        if isinstance(v, dict):
            return {k: tuples(x) for k, x in v.items()}
        return v

    return tuples(msgpack.unpackb(body, ext_hook=hook, raw=False, strict_map_key=False)), offsets


def _same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert got[0] == "T" and got[1] == want.dtype and got[2] == tuple(want.shape)
        t = torch.frombuffer(bytearray(got[3]), dtype=want.dtype) if got[3] else torch.empty(0, dtype=want.dtype)
        assert torch.equal(t.reshape(want.shape), want.detach())
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    else:
        assert got == want and type(got) is type(want)


TENSORS = [
    torch.tensor(3.5, dtype=torch.float64),                       # 0-d
    torch.arange(4, dtype=torch.float64) * 0.25,                  # 1-d, small
    torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),       # 3-d, float32
    torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),      # not contiguous
    torch.ones(3, dtype=torch.float64, requires_grad=True) * 2,   # part of an autograd graph
    torch.empty(0, 5, dtype=torch.float64),                       # no elements
    torch.linspace(0, 1, 3000, dtype=torch.float64),              # > SMALL: sent by reference
]


@pytest.mark.parametrize("k", range(len(TENSORS)))
def test_every_tensor_parses_in_msgpack_with_its_data_64_byte_aligned(k: int) -> None:
    t = TENSORS[k]
    enc = _wire.Encoder()
    enc.value({"id": 7, "op": "scan", "carry": t, "pair": (None, t)})
    body = _body(enc.frame())
    got, offsets = _unpack(body)
    _same(got, {"id": 7, "op": "scan", "carry": t, "pair": (None, t)})
    if t.numel():
        assert offsets and all(o % _wire.ALIGN == 0 for o in offsets), offsets


def test_scalars_strings_and_containers_parse_in_msgpack() -> None:
    value = {
        "ints": [0, 1, 127, 128, 255, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -33, -(2**63)],
        "floats": [0.0, -1.5, 1e300, float("inf")],
        "bools": [True, False, None],
        "strs": ["", "a", "x" * 31, "y" * 32, "z" * 300, "é✓"],
        "nested": {"a": [(1, 2), ()], "b": {"c": []}},
        "many": list(range(20)),
        "wide": {f"k{i}": i for i in range(20)},
    }
    enc = _wire.Encoder()
    enc.value(value)
    got, _ = _unpack(_body(enc.frame()))
    _same(got, value)


def test_what_the_encoder_refuses() -> None:
    with pytest.raises(TypeError, match="float32 or float64"):
        _wire.Encoder().value(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="keys must be strings"):
        _wire.Encoder().value({1: 2})
    with pytest.raises(TypeError, match="cannot send a set"):
        _wire.Encoder().value({1, 2})
    with pytest.raises(OverflowError):
        _wire.Encoder().value(2**64)


def _ext_tensor(t: torch.Tensor, before: int) -> msgpack.ExtType:
    """A tensor ext as docs/protocol.md lays it out, padded as if `before` body
    bytes and an ext32 header came first (msgpack picks the smallest ext form:
    the decoder must not depend on either)."""
    code = {torch.float32: 1, torch.float64: 2}[t.dtype]
    head = 4 + 8 * t.dim()
    pad = (-(before + 6 + head)) % 64
    data = bytes([code, t.dim(), pad, 0]) + struct.pack(f"<{t.dim()}q", *t.shape) + bytes(pad)
    return msgpack.ExtType(1, data + t.contiguous().numpy().tobytes())


def test_replies_built_by_msgpack_decode_to_the_same_values() -> None:
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    s = torch.tensor([1.5, -2.0], dtype=torch.float32)
    reply = {
        "id": 2**40, "n": -5, "f": 0.25, "s8": "q" * 40, "s16": "r" * 300,
        "bin": b"\x00\x01", "none": None, "t": True, "arr16": list(range(20)),
        "map16": {f"m{i}": i for i in range(17)}, "tuple": [msgpack.ExtType(2, b""), 1, "two"],
    }
    body = msgpack.packb(reply, use_bin_type=True)
    prefix = msgpack.packb({**reply, "carry": None}, use_bin_type=True)
    got = _wire.decode(bytearray(body))
    want = dict(reply)
    want["tuple"] = (1, "two")
    assert got == want
    # a map whose last value is a tensor: the 0xc0 of "carry": None becomes an ext
    cut = len(prefix) - 1
    for tensor in (t, s, torch.tensor(7.0, dtype=torch.float64)):
        ext = msgpack.packb(_ext_tensor(tensor, cut), use_bin_type=True)
        raw = bytearray(prefix[:cut] + ext)
        out = _wire.decode(raw)
        assert out["carry"].dtype == tensor.dtype and torch.equal(out["carry"], tensor)
        assert {k: v for k, v in out.items() if k != "carry"} == want


def test_a_truncated_or_unknown_reply_is_an_error() -> None:
    with pytest.raises(ValueError, match="truncated"):
        _wire.decode(bytearray(b"\xa5ab"))
    with pytest.raises(ValueError, match="type byte 0xc1"):
        _wire.decode(bytearray(b"\xc1"))
    with pytest.raises(ValueError, match="unknown ext type 9"):
        _wire.decode(bytearray(msgpack.packb(msgpack.ExtType(9, b"zz"))))

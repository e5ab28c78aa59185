"""The client codec's two fast paths against the reference codec (_wire.py's
Encoder and Decoder, themselves checked against the msgpack package in
test_wire.py):

- torchloop._fast, the C codec the client uses when it was built: its frames
  must be byte-for-byte the Encoder's, its decoded replies equal to the
  Decoder's, and whatever it does not handle (large tensors, shared-memory
  references, other types, malformed bytes) it must hand back (None) so that
  the reference code raises its own error;
- _wire.Replies, the pure-Python decoder that reuses the layout of a reply
  shape it has seen: same values as the Decoder, and a new parse whenever a
  structural byte differs.

Then both paths end to end against a daemon and an eager loop.
"""

from __future__ import annotations

import os
import random
import struct

import msgpack
import pytest
import torch

import bodies
import eager
import torchloop
from torchloop import _wire

fast = _wire.fast


def test_the_c_codec_was_built() -> None:
    # make setup installs client/python with its extension; without it the
    # client silently runs 3x slower per small scan (docs/python.md)
    assert fast is not None, "torchloop._fast is missing: rerun `make setup` (needs a C compiler)"
    # make sanitize runs this suite on a copy built with ASan + UBSan
    where = os.environ.get("TORCHLOOP_TEST_FAST_DIR")
    if where:
        assert os.path.dirname(fast.__file__) == where, fast.__file__


def _random_tree(rng: random.Random, depth: int = 0):
    kinds = ["tensor", "none", "bool", "int", "float", "str"] + (["dict", "list", "tuple"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "tensor":
        dtype = rng.choice([torch.float32, torch.float64])
        shape = tuple(rng.choice([0, 1, 2, 3, 5]) for _ in range(rng.randint(0, 3)))
        t = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(rng.randint(0, 10**6)))
        if t.dim() == 2 and rng.random() < 0.3:
            t = t.t()  # not contiguous
        if rng.random() < 0.2:
            t.requires_grad_()
        return t
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, -1, -32, -33,
                           -(2**31), -(2**63)])
    if kind == "float":
        return rng.choice([0.0, -0.0, 1.5, 1e300, float("inf"), -2.25])
    if kind == "str":
        return rng.choice(["", "a", "é∂", "x" * 31, "y" * 32, "z" * 300])
    n = rng.randint(0, 17 if rng.random() < 0.2 else 4)
    if kind == "dict":
        return {f"k{i}": _random_tree(rng, depth + 1) for i in range(n)}
    items = [_random_tree(rng, depth + 1) for _ in range(n)]
    return items if kind == "list" else tuple(items)


def _reference_frame(rid, op, fields) -> bytes:
    enc = _wire.Encoder()
    enc.value({"id": rid, "op": op, **fields})
    return b"".join(bytes(memoryview(b).cast("B")) for b in enc.frame())


def _same(got, want) -> None:
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(want, float) and want != want:
        assert got != got
    else:
        assert got == want


# ---- the C encoder -----------------------------------------------------------

def test_c_frames_are_the_reference_encoders_byte_for_byte() -> None:
    rng = random.Random(7)
    for i in range(400):
        fields = {"adapter": "a" * rng.randint(1, 40), "carry": _random_tree(rng), "inputs": _random_tree(rng)}
        rid = rng.choice([1, 127, 128, 65536, 2**32 + 5])
        got = fast.encode(rid, "scan", fields, 1 << 20)
        assert got == _reference_frame(rid, "scan", fields), i


def test_c_encoder_hands_back_what_it_does_not_handle() -> None:
    t = torch.ones(4, dtype=torch.float64)
    for fields in (
        {"x": torch.ones(4, dtype=torch.float64), "big": torch.ones(1025, dtype=torch.float64)},  # > limit
        {"x": torch.ones(2, dtype=torch.int64)},  # dtype: the reference raises TypeError
        {"x": torch.eye(2).to_sparse()},  # layout: TypeError
        {"x": {1: t}},  # a non-str key: TypeError
        {"x": {1, 2}},  # a set: TypeError
        {"x": 2**64},  # past 64 bits: OverflowError
        {"x": 2**63},  # fits uint64: the reference encodes it
        {"x": type("S", (str,), {})("s")},  # a str subclass: the reference encodes it
        {"id": 3},  # would repeat the id key: the reference's dict merge decides
    ):
        assert fast.encode(1, "scan", fields, 8192) is None, fields


def test_c_encoder_copies_tensors_up_to_the_limit_exactly() -> None:
    t = torch.arange(1024, dtype=torch.float64)  # 8192 bytes
    assert fast.encode(1, "scan", {"x": t}, 8192) == _reference_frame(1, "scan", {"x": t})
    assert fast.encode(1, "scan", {"x": t}, 8191) is None


# ---- the C decoder -----------------------------------------------------------

def _bodies(seed: int, n: int):
    """Reply-like bodies: random trees through the reference encoder, plus msgpack's own forms."""
    rng = random.Random(seed)
    for _ in range(n):
        tree = {"id": rng.randint(0, 2**40), "result": {"carry": _random_tree(rng), "outputs": _random_tree(rng)}}
        yield _reference_frame(1, "x", tree)[4:]
    yield msgpack.packb({"s8": "q" * 40, "s16": "r" * 300, "bin": b"\x00\x01", "arr16": list(range(20)),
                         "map16": {f"m{i}": i for i in range(17)}, "neg": [-1, -200, -40000, -(2**40)],
                         "u": [200, 40000, 2**40], "tup": [msgpack.ExtType(2, b""), 1, "two"]}, use_bin_type=True)
    yield msgpack.packb([msgpack.ExtType(2, b""), 1.5, None], use_bin_type=True, use_single_float=True)


def test_c_decoder_gives_the_reference_decoders_values() -> None:
    for body in _bodies(11, 300):
        got = fast.decode(bytearray(body))
        assert got is not None
        _same(got, _wire.decode(bytearray(body)))


def test_c_decoded_tensors_view_the_reply_without_a_copy() -> None:
    t = torch.arange(4, dtype=torch.float64)
    body = bytearray(_reference_frame(1, "x", {"t": t})[4:])
    out = fast.decode(body)["t"]
    at = body.find(t.numpy().tobytes())
    body[at:at + 8] = struct.pack("<d", 42.0)
    assert out[0].item() == 42.0


BAD = [
    (b"\xa5ab", "truncated"),
    (b"\xc1", "type byte 0xc1"),
    (msgpack.packb(msgpack.ExtType(9, b"zz")), "unknown ext type 9"),
    (msgpack.packb(msgpack.ExtType(3, bytes(24))), "shared-memory reference"),
    (b"\xdd\xff\xff\xff\xff", "truncated"),  # an array32 of 4G items in 5 bytes
    (b"\xdf\x7f\xff\xff\xff\xc0", "truncated"),  # a map32 likewise
    (b"\x91" * 200 + b"\xc0", None),  # deeper than the C decoder goes: the reference decodes it
    (msgpack.packb(msgpack.ExtType(1, bytes([2, 1, 0, 0]) + struct.pack("<q", 4) + bytes(8))), "overruns"),
    (b"\xc0\xc0", None),  # trailing bytes: the reference reads the first value
]


@pytest.mark.parametrize("body, error", BAD)
def test_c_decoder_hands_back_what_it_does_not_handle(body: bytes, error: str | None) -> None:
    assert fast.decode(bytearray(body)) is None
    if error is None:
        _wire.decode(bytearray(body))
    else:
        with pytest.raises(ValueError, match=error):
            _wire.decode(bytearray(body))


def test_c_decoder_survives_mutated_replies() -> None:
    """Random byte flips, truncations and splices of valid bodies: the C
    decoder returns None or exactly what the reference returns, never a
    crash and never a value the reference refuses."""
    rng = random.Random(3)
    seeds = list(_bodies(5, 40))
    for _ in range(20000):
        body = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.6 and body:
                body[rng.randrange(len(body))] = rng.randrange(256)
            elif op < 0.8 and body:
                del body[rng.randrange(len(body)):]
            else:
                at = rng.randrange(len(body) + 1)
                body[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        got = fast.decode(bytearray(body))
        if got is not None:
            _same(got, _wire.decode(bytearray(body)))


# ---- Replies: the pure-Python decoder's layout reuse ------------------------

def test_replies_reuse_a_layout_only_when_every_structural_byte_matches() -> None:
    r = _wire.Replies()
    a, b = torch.arange(4, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float32)

    def reply(rid, x, y, flag=True):
        return bytearray(_reference_frame(rid, "x", {"result": {"carry": x, "outputs": (y, flag)}})[4:])

    _same(r.decode(reply(70000, a, b)), _wire.decode(reply(70000, a, b)))
    assert r.hits == 0
    out = r.decode(reply(70001, a * 2, b * 3))  # new data and id, same structure
    assert r.hits == 1 and out["id"] == 70001
    _same(out, _wire.decode(reply(70001, a * 2, b * 3)))
    out = r.decode(reply(70002, a, b, flag=False))  # a structural byte differs: parsed again
    assert r.hits == 1 and out["result"]["outputs"][1] is False
    out = r.decode(reply(70003, a, b.double()))  # the same length, another dtype
    assert r.hits == 1 and out["result"]["outputs"][0].dtype == torch.float64


# ---- end to end ------------------------------------------------------------------

@pytest.mark.parametrize("path", ["c", "python"])
def test_both_codec_paths_scan_like_the_eager_loop(daemon: str, monkeypatch, path: str) -> None:
    if path == "python":
        monkeypatch.setattr(_wire, "fast", None)
    adapter = torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=daemon)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # the Python path's second and third replies reuse the first's layout
        carry = torch.rand(4, generator=gen, dtype=torch.float64)
        xs = torch.rand(1, 4, generator=gen, dtype=torch.float64)
        final, ys = adapter.scan(bodies.ema, carry, xs)
        want_final, want_ys = eager.scan(bodies.ema, carry, xs)
        torch.testing.assert_close(final, want_final, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(ys, want_ys, rtol=1e-6, atol=1e-12)
    hits = adapter.scan.__self__.client._replies.hits  # the driver behind scan
    assert hits >= 2 if path == "python" else hits == 0

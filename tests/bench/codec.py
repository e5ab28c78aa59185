"""The Python client's wire codec alone, in process (no daemon, no socket).

usage: codec.py [ITERS]

Times, p50 over ITERS calls (default 20000), encoding one scan request
(N = 4, T = 1, float64: carry [4], inputs [1, 4]) and decoding a reply of the
same shapes -- the work the Python client (column (g) of docs/performance.md)
adds to every call on top of the socket round trip -- three ways:
  python   torchloop._wire.Encoder and torchloop._wire.decode (the reference)
  replies  torchloop._wire.Replies: the pure-Python client's decoder, which
           reuses the layout of a reply shape it has seen
  c        torchloop._fast (the C codec the client uses when it was built)
"""

from __future__ import annotations

import json
import sys

import torch

from torchloop import _wire

from bench import p50_us


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    carry = torch.arange(4, dtype=torch.float64)
    xs = torch.ones(1, 4, dtype=torch.float64)

    def encode():
        e = _wire.Encoder()
        e.value({"id": 7, "op": "scan", "adapter": "bench.cumsum", "carry": carry, "inputs": xs})
        return e.frame()

    # a reply as the daemon sends one: {id, result: {carry, outputs}}
    e = _wire.Encoder()
    e.value({"id": 7, "result": {"carry": carry, "outputs": xs}})
    body = bytearray(b"".join(bytes(memoryview(b).cast("B")) for b in e.frame())[4:])
    replies = _wire.Replies()
    replies.decode(bytearray(body))
    out = {"iters": iters,
           "python": {"encode_p50_us": round(p50_us(encode, iters), 2),
                      "decode_p50_us": round(p50_us(lambda: _wire.decode(body), iters), 2)},
           "replies": {"decode_p50_us": round(p50_us(lambda: replies.decode(body), iters), 2)}}
    fast = _wire.fast
    if fast is not None:
        fields = {"adapter": "bench.cumsum", "carry": carry, "inputs": xs}
        out["c"] = {"encode_p50_us": round(p50_us(lambda: fast.encode(7, "scan", fields, 65536), iters), 2),
                    "decode_p50_us": round(p50_us(lambda: fast.decode(body), iters), 2)}
    print(json.dumps(out))

if __name__ == "__main__":
    main()

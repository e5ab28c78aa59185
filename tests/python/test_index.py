"""An index a captured graph reads from its inputs, out of range (issue 53
row 2): the package raises what eager torch raises (IndexError, here also a
RuntimeError: TorchloopIndexError), and the daemon serves the next scan.
The body is a closure over a 16-row table, captured by the package; one
specialization (float64, T=3, carry [4]) on the session's daemon."""

from __future__ import annotations

import math

import pytest
import torch

import eager
import torchloop


def make_body():
    table = torch.arange(16, dtype=torch.float64) * 0.5 + 1.0

    def body(carry: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = table[x.long()]  # indices from the scan's input
        return carry + row, row * x

    return body


def good_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    xs = torch.tensor([[(i * 5) % 16 - (16 if i % 3 == 0 else 0) for i in range(4 * r, 4 * r + 4)]
                       for r in range(3)], dtype=torch.float64)
    return torch.arange(1.0, 5.0, dtype=torch.float64), xs


def test_an_index_out_of_range_raises_what_eager_raises_and_the_daemon_serves_on(
        daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=daemon)
    body = make_body()
    carry, xs = good_inputs()
    got = adapter.scan(body, carry, xs)  # compiled with in-range values
    want = eager.scan(body, carry, xs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=0)
    for bad in (20.0, -17.0, math.nan):
        bad_xs = xs.clone()
        bad_xs[1, 2] = bad
        with pytest.raises(IndexError) as eager_exc:
            eager.scan(body, carry, bad_xs)
        with pytest.raises(type(eager_exc.value)) as exc:
            adapter.scan(body, carry, bad_xs)
        assert isinstance(exc.value, torchloop.TorchloopIndexError)
        assert isinstance(exc.value, RuntimeError)
        assert exc.value.code == "INDEX_OUT_OF_RANGE"
        again = adapter.scan(body, carry, xs)  # the daemon serves on, correctly
        for g, w in zip(again, want):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=0)

"""loop_adapter(dynamic="batch"): one graph per (structure, T, dtype) serves
every batch size -- dimension 0 of the carry's leaves, 1 of the inputs'.
Scans and backward at several batch sizes (1 included) against the eager
loop and eager autograd; the daemon's describe counts one graph per kind.
A checkpointed backward under dynamic = batch is the plain VJP over a
symbolic batch (torch's Inductor cannot lower the scan op over one), and
says so.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import bodies
import eager
import torchloop

T = 3
BATCHES = (5, 1, 12, 2)


def trees(batch: int, seed: int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(seed)
    h = torch.rand(batch, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    f = torch.rand(T, batch, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    return (h, None), {"f": f}


def loss(final: tuple, ys: dict) -> torch.Tensor:
    h, _ = final
    return (h * h).sum() + ys["y"].pow(3).sum() + (ys["h2"][0] * 0.25).sum()


def check(adapter: torchloop.LoopAdapter, body: Callable[..., Any], batch: int,
          seed: int) -> None:
    """One scan and its backward at this batch size against the eager loop
    (body may be adapter.checkpoint(bodies.rnn): the eager loop runs rnn)."""
    carry, inputs = trees(batch, seed)
    final, ys = adapter.scan(body, carry, inputs)
    want_final, want_ys = eager.scan(bodies.rnn, carry, inputs)
    torch.testing.assert_close(final[0], want_final[0], rtol=1e-12, atol=1e-12)
    assert final[1] is None and ys["skip"] is None
    torch.testing.assert_close(ys["y"], want_ys["y"], rtol=1e-12, atol=1e-12)
    assert ys["y"].shape == (T, batch, 1)
    got = torch.autograd.grad(loss(final, ys), (carry[0], inputs["f"]))
    want = torch.autograd.grad(loss(want_final, want_ys), (carry[0], inputs["f"]))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_one_graph_per_kind_serves_every_batch_size(daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=4, max_elements=4096, socket=daemon,
                                     dynamic="batch", name="py.dynamic.rnn")
    for i, batch in enumerate(BATCHES):
        check(adapter, bodies.rnn, batch, 10 + i)
    with torchloop.Client(daemon) as client:
        described = client.describe("py.dynamic.rnn")
    assert described["dynamic"] == "batch"
    assert described["counters"]["graphs"] == 2  # scan and grad, for four batch sizes
    assert {s["signature"] for s in described["specializations"]} == {
        'float64 T=3 carry=t([B,4],N) inputs=d(1:f=[3,B,4])'}


def test_leaves_of_other_batch_sizes_raise_a_value_error_with_the_path(daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=4, max_elements=4096, socket=daemon,
                                     dynamic="batch", name="py.dynamic.rnn")
    carry, inputs = trees(3, 1)
    with pytest.raises(ValueError) as info:
        adapter.scan(bodies.rnn, carry, {"f": torch.rand(T, 4, 4, dtype=torch.float64)})
    assert info.value.code == "BATCH_MISMATCH" and info.value.path == 'inputs["f"]'
    final, _ = adapter.scan(bodies.rnn, carry, inputs)  # and the next one is served
    assert final[0].shape == (3, 4)


def test_an_unknown_dynamic_mode_is_refused_before_connecting() -> None:
    with pytest.raises(ValueError, match='dynamic must be "none" or "batch"'):
        torchloop.loop_adapter(dynamic="rows", socket="/nonexistent/sock")


def test_a_checkpointed_backward_over_a_symbolic_batch_is_the_plain_vjp_and_says_so(
        daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=4, max_elements=4096, socket=daemon,
                                     dynamic="batch", name="py.dynamic.rnn")
    for i, batch in enumerate((3, 1)):
        check(adapter, adapter.checkpoint(bodies.rnn), batch, 30 + i)
    with torchloop.Client(daemon) as client:
        described = client.describe("py.dynamic.rnn")
    (ckpt,) = [s for s in described["specializations"] if s["kind"] == "grad_checkpoint"]
    assert ckpt["lowered"] == "unroll"
    assert "dynamic = batch: the checkpointed VJP needs the scan op" in ckpt["note"]


"""`adapter.checkpoint(body)`: the backward keeps each step's carry and
recomputes the step (the daemon's grad_checkpoint graph, daemon/worker/
checkpoint.py).  Three bodies -- elementwise, a matmul over a captured
weight that requires grad, a dict carry with a leaf the step passes through
unchanged -- each against the plain body through the adapter and against
eager autograd (float64, 1e-10); the solver's idiom `adapter.checkpoint(f)
if adapter.checkpoint else f`; a module-level body registered by source;
the checkpointed graph is a specialization of its own; bad requests get
INVALID_ARGUMENT and the daemon serves the next one.

Compiles (T = 4): per body a forward and a checkpointed VJP, the
elementwise body's plain VJP (7); the source body's forward and
checkpointed VJP (2).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import bodies
import eager
import torchloop
from torchloop.errors import TorchloopError

T = 4
TOL = dict(rtol=1e-10, atol=1e-10)
Body = Callable[[Any, Any], tuple[Any, Any]]


@pytest.fixture(scope="module")
def adapter(daemon: str) -> Any:
    return torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=daemon)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def elementwise() -> tuple[Body, Any, Any, list[torch.Tensor]]:
    def body(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        new = 0.9 * c + 0.1 * torch.sin(x) * c
        return new, new * new

    return body, rand(4, seed=1), rand(T, 4, seed=2), []


def matmul() -> tuple[Body, Any, Any, list[torch.Tensor]]:
    W = (rand(5, 5, seed=3) - 0.5).requires_grad_()

    def body(h: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        h2 = torch.tanh(h @ W + x)
        return h2, (h2 * h2).sum(-1)

    return body, rand(3, 5, seed=4), rand(T, 5, seed=5), [W]


def dict_carry() -> tuple[Body, Any, Any, list[torch.Tensor]]:
    def body(c: dict[str, Any], x: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        a = c["a"] * torch.cos(x["f"]) + c["scale"] * x["g"]
        # "scale" goes through unchanged: the checkpointed graph keeps it once
        return {"a": a, "scale": c["scale"], "none": None}, (a.sum(), None)

    carry = {"a": rand(2, 3, seed=6), "scale": rand(2, 3, seed=7), "none": None}
    return body, carry, {"f": rand(T, 2, 3, seed=8), "g": rand(T, 2, 3, seed=9)}, []


def grads_of(scan: Callable[..., Any], body: Any, carry: Any, xs: Any,
             params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Results and the gradients of a weighted sum with respect to every
    carry and input leaf and the captured tensors."""
    carry = eager.tree_map(lambda t: t.clone().requires_grad_(), carry)
    xs = eager.tree_map(lambda t: t.clone().requires_grad_(), xs)
    for p in params:
        p.grad = None
    final, ys = scan(body, carry, xs)
    outs = eager.leaves(final) + eager.leaves(ys)
    gen = torch.Generator().manual_seed(11)
    sum(((o * torch.rand(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs)).backward()
    return [o.detach() for o in outs] + [t.grad for t in eager.leaves(carry) + eager.leaves(xs)] \
        + [p.grad.clone() for p in params]


@pytest.mark.parametrize("make", [elementwise, matmul, dict_carry], ids=lambda f: f.__name__)
def test_checkpointed_gradients_match_the_plain_body_and_eager_autograd(adapter: Any,
                                                                        make: Any) -> None:
    """Against the plain body's eager autograd; for the elementwise body also
    against the plain body through the daemon (its VJP graph, which the
    specialization test below needs too: one compile for both)."""
    body, carry, xs, params = make()
    ours = grads_of(adapter.scan, adapter.checkpoint(body), carry, xs, params)
    want = grads_of(eager.scan, body, carry, xs, params)
    plain = grads_of(adapter.scan, body, carry, xs, params) if make is elementwise else want
    assert len(ours) == len(want)
    for a, b, w in zip(ours, plain, want):
        torch.testing.assert_close(a, w, **TOL)
        torch.testing.assert_close(b, w, **TOL)


def test_the_solver_idiom_and_a_direct_call(adapter: Any) -> None:
    advance, carry, xs, _ = elementwise()
    body = adapter.checkpoint(advance) if adapter.checkpoint else advance
    assert isinstance(body, torchloop.adapter.Checkpointed)
    torch.testing.assert_close(body(carry, xs[0])[0], advance(carry, xs[0])[0], rtol=0, atol=0)
    got = grads_of(adapter.scan, body, carry, xs, [])
    for a, w in zip(got, grads_of(eager.scan, advance, carry, xs, [])):
        torch.testing.assert_close(a, w, **TOL)
    with pytest.raises(TypeError, match="checkpoint needs a callable"):
        adapter.checkpoint(3)


def test_the_checkpointed_graph_is_a_specialization_of_its_own(adapter: Any, daemon: str) -> None:
    body, carry, xs, _ = elementwise()
    grads_of(adapter.scan, adapter.checkpoint(body), carry, xs, [])
    grads_of(adapter.scan, body, carry, xs, [])
    with torchloop.Client(daemon) as client:
        specs = [s for a in client.list() if a["name"].startswith("g.")
                 for s in client.describe(a["name"])["specializations"]
                 if s["signature"].startswith("float64 T=4 carry=t([4]")]
    kinds = {s["kind"]: s for s in specs}
    # the plain body's backward: the saved pair (test_saved.py)
    assert {"scan", "grad_saved", "grad_checkpoint"} <= set(kinds), kinds.keys()
    ck = kinds["grad_checkpoint"]
    assert ck["key"] != kinds["grad_saved"]["key"]
    assert ck["lowered"] == "scan" and "checkpointed" in ck["note"], ck


def test_a_source_body_checkpointed(daemon: str) -> None:
    src = torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=daemon, capture=False)
    carry, xs = rand(4, seed=12), rand(T, 4, seed=13)
    got = grads_of(src.scan, src.checkpoint(bodies.ema), carry, xs, [])
    for a, w in zip(got, grads_of(eager.scan, bodies.ema, carry, xs, [])):
        torch.testing.assert_close(a, w, **TOL)


def test_bad_checkpoint_and_kind_fields_are_refused(adapter: Any, daemon: str) -> None:
    body, carry, xs, _ = elementwise()
    adapter.scan(body, carry, xs)
    name = next(iter(adapter.scan.__self__.graphs))  # a graph adapter of this test's
    with torchloop.Client(daemon) as client:
        with pytest.raises(TorchloopError) as bad:
            client.call("grad", adapter=name, carry=(carry, ()), inputs=xs, checkpoint="yes")
        assert (bad.value.code, bad.value.path) == ("INVALID_ARGUMENT", "checkpoint")
        with pytest.raises(TorchloopError) as bad:
            client.call("compile", adapter=name, dtype="float64", kind="backward",
                        carry=None, inputs=None)
        assert (bad.value.code, bad.value.path) == ("INVALID_ARGUMENT", "kind")
        assert client.health()["ready"]
    final, _ = adapter.scan(body, carry, xs)  # and it serves the next scan
    torch.testing.assert_close(final, eager.scan(body, carry, xs)[0], **TOL)

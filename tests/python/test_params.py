"""`params` on scan and grad (docs/protocol.md): tensors every step reads
unchanged, not sent back; their gradients come as grad_params.  A source
adapter over the Client, against the eager loop and eager autograd; bad
params get their code and a path that says `params`, and the daemon serves on.
"""

from __future__ import annotations

import torch
import pytest

import torchloop

BODY = """
def body(carry, x):
    c, (w,) = carry
    c = 0.5 * c + w * x
    return (c, (w,)), c * c


def shrinks(carry, x):
    c, (w,) = carry
    return (c + w * x, (w[:2],)), c
"""
T, N = 3, 4
TOL = dict(rtol=1e-10, atol=1e-10)


def eager(c: torch.Tensor, xs: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ys = []
    for x in xs:
        c = 0.5 * c + w * x
        ys.append(c * c)
    return c, torch.stack(ys)


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.rand(s, generator=gen, dtype=torch.float64) for s in ((N,), (T, N), (N,)))


@pytest.fixture(scope="module")
def client(daemon: str) -> torchloop.Client:
    with torchloop.Client(daemon) as c:
        c.register("p.lin", BODY, entry="body", max_steps=8, max_elements=64)
        c.register("p.shrinks", BODY, entry="shrinks", max_steps=8, max_elements=64)
        yield c


def test_params_are_read_by_every_step_and_not_sent_back(client: torchloop.Client) -> None:
    c, xs, w = data(1)
    final, ys = client.scan("p.lin", c, xs, params=(w,))
    want_c, want_ys = eager(c, xs, w)
    assert isinstance(final, torch.Tensor), "the final carry is the carry alone"
    torch.testing.assert_close(final, want_c, **TOL)
    torch.testing.assert_close(ys, want_ys, **TOL)


def test_grad_params_are_the_gradients_of_the_params(client: torchloop.Client) -> None:
    c, xs, w = data(2)
    cot_c, cot_ys = data(3)[0], data(4)[1]
    res = client.grad("p.lin", c, xs, cot_carry=cot_c, cot_outputs=cot_ys, params=(w,))
    assert set(res) >= {"carry", "outputs", "grad_carry", "grad_inputs", "grad_params"}
    leaves = [t.clone().requires_grad_() for t in (c, xs, w)]
    fc, fys = eager(*leaves)
    torch.autograd.backward([fc, fys], [cot_c, cot_ys])
    torch.testing.assert_close(res["carry"], fc.detach(), **TOL)
    torch.testing.assert_close(res["grad_carry"], leaves[0].grad, **TOL)
    torch.testing.assert_close(res["grad_inputs"], leaves[1].grad, **TOL)
    assert isinstance(res["grad_params"], tuple) and len(res["grad_params"]) == 1
    torch.testing.assert_close(res["grad_params"][0], leaves[2].grad, **TOL)


def test_bad_params_say_params_and_the_daemon_serves_on(client: torchloop.Client) -> None:
    c, xs, w = data(5)
    with pytest.raises(torchloop.TorchloopError) as exc:
        client.scan("p.lin", c, xs, params=(w.float(),))
    assert exc.value.code == "DTYPE_MISMATCH" and exc.value.path == "params[0]", exc.value
    with pytest.raises(torchloop.TorchloopError) as exc:
        client.scan("p.lin", c, xs, params=(torch.zeros(100, dtype=torch.float64),))
    assert exc.value.code == "TOO_MANY_ELEMENTS" and exc.value.path == "params[0]", exc.value
    with pytest.raises(torchloop.TorchloopError) as exc:  # the body changes a param's shape
        client.scan("p.shrinks", c, xs, params=(w,))
    assert exc.value.code == "CARRY_MISMATCH", exc.value
    assert exc.value.path.startswith("params[0]") and "carry[1]" not in exc.value.message, \
        exc.value
    final, _ = client.scan("p.lin", c, xs, params=(w,))
    torch.testing.assert_close(final, eager(c, xs, w)[0], **TOL)

"""The backward that does not run the forward again (docs/protocol.md, `scan`
with `save`, `grad` with `saved`; worker saved.py): a scan with gradients
keeps what the backward needs in the connection's region, and its backward
runs the graph that uses it.  Gradients are checked against eager autograd
of the same loop; every bad saved, saved_key, wrt or save gets its code and
path, and the daemon serves the next request.

Compiles: the solver's pair (with a wrt mask), bodies.ema's pair at T=3 and
its plain grad (save=False), a pair for the bad requests (ema at T=2), and
the refused pair of a body whose backward keeps an index (plus its plain
scan and grad): about 11.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import bodies
import bodyforms
import eager
import torchloop
from conftest import running_daemon
from torchloop.errors import TorchloopError

TOL = dict(rtol=1e-10, atol=1e-12)


def kinds(sock: str, name: str) -> dict[str, dict[str, Any]]:
    with torchloop.Client(sock) as c:
        return {s["kind"]: s for s in c.describe(name)["specializations"]}


def names(sock: str) -> set[str]:
    with torchloop.Client(sock) as c:
        return {a["name"] for a in c.list()}


def test_a_solver_closure_backward_uses_what_its_forward_kept(daemon: str) -> None:
    """The step built inside a method per run (closure over the solver, its
    rhs callback and the captured forcing), carry (state, None), inputs a
    tuple of 1-D tensors that do not require grad: the saved pair, with a
    wrt mask, and gradients equal to eager autograd's."""
    before = names(daemon)
    adapter = torchloop.loop_adapter(max_steps=8, socket=daemon)
    y0, times, dts, forcing = bodyforms.solver_inputs(5, 4)
    solver = bodyforms.Solver(bodyforms.rhs, 0.25)

    def loss(scan: Any) -> torch.Tensor:
        (final, none), ys = solver.run(scan, y0, times, dts, forcing)
        assert none is None
        return (final * final).sum() + (ys * torch.arange(1.0, 5.0, dtype=ys.dtype)).sum()

    got = torch.autograd.grad(loss(adapter.scan), [y0, forcing])
    want = torch.autograd.grad(loss(eager.scan), [y0, forcing])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    (name,) = names(daemon) - before
    ks = kinds(daemon, name)
    assert set(ks) == {"scan_save", "grad_saved"}, ks  # no VJP graph ran the forward again
    assert ks["grad_saved"]["signature"].endswith(";wrt=" + ks["scan_save"]["signature"]
                                                  .split(";wrt=")[1])
    assert "0" in ks["grad_saved"]["signature"].split(";wrt=")[1]  # times, dts: no gradient


def test_saved_lives_in_the_region_and_dies_with_the_autograd_graph(daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=8, socket=daemon)
    gen = torch.Generator().manual_seed(2)
    n = 16384  # every tensor at the client's shared-memory threshold (128 KiB)
    c0 = torch.rand(n, generator=gen, dtype=torch.float64, requires_grad=True)
    xs = torch.rand(3, n, generator=gen, dtype=torch.float64, requires_grad=True)
    client = adapter.scan.__self__.client

    final, ys = adapter.scan(bodies.ema, c0, xs)  # compiles, sizes the output area
    (final.sum() + ys.sum()).backward()
    del final, ys
    gc.collect()
    region = client._region
    assert region is not None
    free = region.bytes_free()

    final, ys = adapter.scan(bodies.ema, c0, xs)
    node = final.grad_fn
    kept = node.kept
    assert kept is not None and region.offset_of(kept[0]) is not None  # saved, in the region
    assert region.bytes_free() < free
    del final, ys, node, kept
    gc.collect()
    assert region.bytes_free() == free  # a forward whose backward never came: freed


def test_gradients_match_eager_with_and_without_save(daemon: str) -> None:
    gen = torch.Generator().manual_seed(4)
    c0 = torch.rand(4, generator=gen, dtype=torch.float64)
    xs = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    grads = []
    for scan in (torchloop.loop_adapter(max_steps=8, socket=daemon).scan,
                 torchloop.loop_adapter(max_steps=8, socket=daemon, save=False).scan, eager.scan):
        c, x = c0.clone().requires_grad_(), xs.clone().requires_grad_()
        final, ys = scan(bodies.ema, c, x)
        (final.pow(2).sum() + ys.sum()).backward()
        grads.append((c.grad, x.grad))
    for got in grads[:2]:
        for g, w in zip(got, grads[2]):
            torch.testing.assert_close(g, w, **TOL)


W5 = torch.linspace(-1.0, 1.0, 25, dtype=torch.float64).reshape(5, 5)


def argmax_body(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Its backward keeps max's index (min cut: one index is cheaper to keep
    than the matmul it would recompute), which saved cannot carry."""
    m = torch.max(torch.outer(c, x) @ W5, dim=1)
    return c * 0.5 + m.values, m.values


def test_a_body_whose_backward_keeps_an_index_falls_back_to_the_plain_grad(daemon: str) -> None:
    adapter = torchloop.loop_adapter(max_steps=8, socket=daemon)
    gen = torch.Generator().manual_seed(6)
    c0 = torch.rand(5, generator=gen, dtype=torch.float64)
    xs = torch.rand(3, 5, generator=gen, dtype=torch.float64)
    grads = []
    for scan in (adapter.scan, adapter.scan, eager.scan):  # the second: straight to the plain way
        c, x = c0.clone().requires_grad_(), xs.clone().requires_grad_()
        final, ys = scan(argmax_body, c, x)
        (final.sum() + ys.sum()).backward()
        grads.append((c.grad, x.grad))
    for got in grads[:2]:
        for g, w in zip(got, grads[2]):
            torch.testing.assert_close(g, w, **TOL)
    driver = adapter.scan.__self__
    (name,) = driver.unsaved
    ks = kinds(daemon, name)
    assert ks["scan_save"]["state"] == "failed"
    assert ks["scan_save"]["error"] == "COMPILE_FAILED", ks["scan_save"]
    assert ks["grad"]["state"] == "ready"


def test_a_reply_over_the_frame_limit_is_refused_and_the_pair_falls_back(tmp_path: Any) -> None:
    """Without shared memory saved comes back inline: over --max-frame the
    daemon answers FRAME_TOO_LARGE (it used to drop the reply, and the client
    waited for ever), serves the next request, and the package goes the
    plain way with the right gradients."""
    gen = torch.Generator().manual_seed(8)
    # bodies.mm_chain, carry [225, 16], inputs [3, 1]: a scan sends 28 KiB and
    # gets 28 back (y is one number a step), but with saved (the matmuls'
    # results) over 100 KiB; the grad of the final carry sends 56 KiB
    c0 = torch.rand(225, 16, generator=gen, dtype=torch.float64)
    xs = torch.rand(3, 1, generator=gen, dtype=torch.float64)
    with running_daemon(tmp_path, "--max-frame", "65536") as sock:
        with torchloop.Client(sock, shm=0) as c:
            c.register("big.chain", open(bodies.__file__).read(), "mm_chain", max_steps=4)
            with pytest.raises(TorchloopError) as info:
                c.call("scan", adapter="big.chain", carry=c0, inputs=xs, save=True)
            assert info.value.code == "FRAME_TOO_LARGE" and "--max-frame" in str(info.value)
            final, _ = c.scan("big.chain", c0, xs)  # the connection serves on
            torch.testing.assert_close(final, eager.scan(bodies.mm_chain, c0, xs)[0], **TOL)
        adapter = torchloop.loop_adapter(max_steps=4, socket=sock, capture=False)
        adapter.scan.__self__.client.shm_size = 0  # every tensor inline
        c, x = c0.clone().requires_grad_(), xs.clone().requires_grad_()
        final, ys = adapter.scan(bodies.mm_chain, c, x)
        final.sum().backward()
        assert adapter.scan.__self__.unsaved  # the plain way from now on
        ce, xe = c0.clone().requires_grad_(), xs.clone().requires_grad_()
        final, ys = eager.scan(bodies.mm_chain, ce, xe)
        final.sum().backward()
        torch.testing.assert_close(c.grad, ce.grad, **TOL)
        torch.testing.assert_close(x.grad, xe.grad, **TOL)


# ---- bad requests: each gets its code and path; the daemon serves on -----------


@pytest.fixture(scope="module")
def ema2(daemon: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A source adapter of bodies.ema (admin), T = 2: its saved pair's scan reply."""
    src = bodies.__file__
    with torchloop.Client(daemon) as c:
        c.register("saved.ema", open(src).read(), "ema", max_steps=4)
        fields = dict(adapter="saved.ema", carry=torch.rand(3, dtype=torch.float64),
                      inputs=torch.rand(2, 3, dtype=torch.float64))
        return "saved.ema", fields, c.call("scan", save=True, **fields)


def good_grad(sock: str, fields: dict[str, Any], reply: dict[str, Any]) -> None:
    """The next request after a refusal: served, and equal to eager autograd."""
    with torchloop.Client(sock) as c:
        cot = torch.ones(3, dtype=torch.float64)
        got = c.call("grad", saved=reply["saved"], saved_key=reply["saved_key"], cot_carry=cot,
                     **fields)
    assert set(got) >= {"grad_carry", "grad_inputs"} and "carry" not in got
    c0 = fields["carry"].clone().requires_grad_()
    x = fields["inputs"].clone().requires_grad_()
    final, _ = eager.scan(bodies.ema, c0, x)
    want = torch.autograd.grad(final, [c0, x], cot)
    torch.testing.assert_close(got["grad_carry"], want[0], **TOL)
    torch.testing.assert_close(got["grad_inputs"], want[1], **TOL)


@pytest.mark.parametrize("change, code, path", [
    (dict(saved=lambda s: s[:-1]), "SAVED_MISMATCH", "saved"),
    (dict(saved=lambda s: s.to(torch.float32)), "SAVED_MISMATCH", "saved"),
    (dict(saved=lambda s: s.reshape(1, -1)), "SAVED_MISMATCH", "saved"),
    (dict(saved=lambda s: [s]), "SAVED_MISMATCH", "saved"),
    (dict(saved_key=lambda k: "0" * 64), "SAVED_MISMATCH", "saved_key"),
    (dict(saved_key=lambda k: None), "INVALID_ARGUMENT", "saved_key"),
    (dict(checkpoint=lambda _: True), "INVALID_ARGUMENT", "saved"),
    (dict(wrt=lambda _: "1"), "INVALID_ARGUMENT", "wrt"),
    (dict(wrt=lambda _: "1x"), "INVALID_ARGUMENT", "wrt"),
])
def test_a_bad_saved_grad_gets_its_code_and_the_daemon_serves_on(
        daemon: str, ema2: tuple[str, dict[str, Any], dict[str, Any]], change: dict[str, Any],
        code: str, path: str) -> None:
    _, fields, reply = ema2
    bad: dict[str, Any] = dict(saved=reply["saved"], saved_key=reply["saved_key"])
    for k, fn in change.items():
        bad[k] = fn(bad.get(k))
    bad = {k: v for k, v in bad.items() if v is not None}
    with torchloop.Client(daemon) as c, pytest.raises(TorchloopError) as info:
        c.call("grad", cot_carry=torch.ones(3, dtype=torch.float64), **bad, **fields)
    assert (info.value.code, info.value.path) == (code, path), info.value
    good_grad(daemon, fields, reply)


@pytest.mark.parametrize("extra, code, path", [
    (dict(save="yes"), "INVALID_ARGUMENT", "save"),
    (dict(wrt="11"), "INVALID_ARGUMENT", "wrt"),  # wrt without save
    (dict(save=True, wrt="111"), "INVALID_ARGUMENT", "wrt"),  # 2 leaves
])
def test_a_bad_save_scan_gets_its_code_and_the_daemon_serves_on(
        daemon: str, ema2: tuple[str, dict[str, Any], dict[str, Any]], extra: dict[str, Any],
        code: str, path: str) -> None:
    _, fields, reply = ema2
    with torchloop.Client(daemon) as c, pytest.raises(TorchloopError) as info:
        c.call("scan", **extra, **fields)
    assert (info.value.code, info.value.path) == (code, path), info.value
    good_grad(daemon, fields, reply)


def test_save_on_an_adapter_of_another_strategy_is_invalid(
        daemon: str, ema2: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    _, fields, reply = ema2
    with torchloop.Client(daemon) as c:
        c.register("saved.ema.scan", open(bodies.__file__).read(), "ema", max_steps=4,
                   strategy="scan")
        for op, more in (("scan", dict(save=True)),
                         ("grad", dict(saved=reply["saved"], saved_key=reply["saved_key"]))):
            with pytest.raises(TorchloopError) as info:
                c.call(op, **{**fields, "adapter": "saved.ema.scan"}, **more)
            assert info.value.code == "INVALID_ARGUMENT", info.value
            assert info.value.path == ("save" if op == "scan" else "saved")
            assert "strategy unroll" in str(info.value)
    good_grad(daemon, fields, reply)

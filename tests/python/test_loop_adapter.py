"""The torchloop Python package against a real daemon: the reference
LoopAdapter contract (bounds and messages, trees with None, both dtypes,
T=1 and T=max_steps), autograd against eager autograd, errors carrying the
daemon's code and leaf path, two solver processes on one daemon, and the
namespace registry a solver finds the adapter in.  References are eager
loops (tests/python/eager.py), never the daemon's own output.
"""

from __future__ import annotations

import multiprocessing
import sys
import types

import pytest
import torch

import bodies
import eager
import torchloop

MAX_STEPS = 8
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-6)}


@pytest.fixture(scope="module")
def adapter(daemon: str):
    return torchloop.loop_adapter(max_steps=MAX_STEPS, max_elements=4096, socket=daemon)


def inputs_for(T: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(4, generator=gen, dtype=dtype), torch.rand(T, 4, generator=gen, dtype=dtype))


# ---- bounds: the reference adapter's checks and messages --------------------

@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_steps=0), "max_steps must be an integer in [1, 128]"),
        (dict(max_steps=129), "max_steps must be an integer in [1, 128]"),
        (dict(max_steps=True), "max_steps must be an integer in [1, 128]"),
        (dict(max_steps=8.0), "max_steps must be an integer in [1, 128]"),
        (dict(max_elements=0), "max_elements must be an integer in [1, 1048576]"),
        (dict(max_elements=1_048_577), "max_elements must be an integer in [1, 1048576]"),
        (dict(max_elements="65536"), "max_elements must be an integer in [1, 1048576]"),
    ],
)
def test_bad_bounds_raise_the_reference_messages(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        torchloop.loop_adapter(**kwargs)
    assert str(info.value) == message


def test_an_adapter_has_the_loop_adapter_shape() -> None:
    a = torchloop.loop_adapter(socket="/nonexistent/sock")  # nothing connects yet
    assert callable(a.scan) and callable(a.checkpoint)


# ---- scans --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T", [1, MAX_STEPS])
def test_a_scan_matches_the_eager_loop(adapter, dtype: torch.dtype, T: int) -> None:
    carry, xs = inputs_for(T, dtype)
    final, ys = adapter.scan(bodies.ema, carry, xs)
    want_final, want_ys = eager.scan(bodies.ema, carry, xs)
    assert final.dtype == dtype and ys.shape == (T, 4)
    torch.testing.assert_close(final, want_final, **TOL[dtype])
    torch.testing.assert_close(ys, want_ys, **TOL[dtype])


def test_trees_round_trip_exactly_with_none_leaves(adapter) -> None:
    gen = torch.Generator().manual_seed(1)
    carry = (torch.rand(2, 3, generator=gen, dtype=torch.float64), None)
    xs = {"f": torch.rand(3, 2, 3, generator=gen, dtype=torch.float64)}
    final, ys = adapter.scan(bodies.rnn, carry, xs)
    want_final, want_ys = eager.scan(bodies.rnn, carry, xs)
    assert isinstance(final, tuple) and final[1] is None
    assert list(ys) == ["y", "skip", "h2"] and ys["skip"] is None and isinstance(ys["h2"], list)
    torch.testing.assert_close(final[0], want_final[0], **TOL[torch.float64])
    torch.testing.assert_close(ys["y"], want_ys["y"], **TOL[torch.float64])
    torch.testing.assert_close(ys["h2"][0], want_ys["h2"][0], **TOL[torch.float64])


# ---- autograd -----------------------------------------------------------------

def _grads(scan, body, carry, xs, loss):
    c = carry.clone().requires_grad_()
    x = xs.clone().requires_grad_()
    final, ys = scan(body, c, x)
    loss(final, ys).backward()
    return c.grad, x.grad


def test_backward_matches_eager_autograd(adapter) -> None:
    carry, xs = inputs_for(MAX_STEPS, torch.float64, seed=2)

    def loss(final, ys):
        return (final * torch.arange(4.0, dtype=final.dtype)).sum() + (ys**2).sum()

    got = _grads(adapter.scan, bodies.ema, carry, xs, loss)
    want = _grads(eager.scan, bodies.ema, carry, xs, loss)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_backward_through_a_tree_with_none_leaves(adapter) -> None:
    gen = torch.Generator().manual_seed(3)
    h0 = torch.rand(2, 3, generator=gen, dtype=torch.float64)
    f = torch.rand(3, 2, 3, generator=gen, dtype=torch.float64)
    grads = []
    for scan in (adapter.scan, eager.scan):
        h, x = h0.clone().requires_grad_(), f.clone().requires_grad_()
        (hf, _), ys = scan(bodies.rnn, (h, None), {"f": x})
        (hf.sum() + ys["y"].pow(2).sum()).backward()  # ys["h2"] unused: zero cotangent
        grads.append((h.grad, x.grad))
    for g, w in zip(*grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_double_backward_is_refused(adapter) -> None:
    carry, xs = inputs_for(MAX_STEPS, torch.float64, seed=2)
    c = carry.clone().requires_grad_()
    final, _ = adapter.scan(bodies.ema, c, xs)
    with pytest.raises(RuntimeError, match="first order only"):
        torch.autograd.grad(final.sum(), c, create_graph=True)
    (g,) = torch.autograd.grad(final.sum(), c)  # first order still works
    assert not g.requires_grad


# ---- errors -------------------------------------------------------------------

def test_daemon_errors_raise_with_code_and_leaf_path(adapter) -> None:
    carry, xs = inputs_for(MAX_STEPS + 1, torch.float64)
    with pytest.raises(ValueError) as info:
        adapter.scan(bodies.ema, carry, xs)
    assert info.value.code == "TOO_MANY_STEPS" and info.value.path == "inputs"
    with pytest.raises(TypeError) as info:
        adapter.scan(bodies.ema, carry.float(), xs[:2])
    assert info.value.code == "DTYPE_MISMATCH"
    carry, xs = inputs_for(2, torch.float64)
    final, _ = adapter.scan(bodies.ema, carry, xs)  # the daemon serves on
    torch.testing.assert_close(final, eager.scan(bodies.ema, carry, xs)[0])


def test_client_side_checks_are_type_errors(adapter) -> None:
    carry, xs = inputs_for(2, torch.float64)
    with pytest.raises(TypeError, match=r"inputs\[1\]: leaves must be tensors"):
        adapter.scan(bodies.ema, carry, [xs, 3])
    with pytest.raises(TypeError, match="body must be a callable"):
        adapter.scan(42, carry, xs)
    # registering source (capture=False) still takes module-level functions only
    source = torchloop.loop_adapter(max_steps=MAX_STEPS, socket="/nonexistent", capture=False)
    with pytest.raises(TypeError, match="module-level function"):
        source.scan(lambda c, x: (c, x), carry, xs)


# ---- sharing ------------------------------------------------------------------

def _solver(sock: str, seed: int, out: "multiprocessing.Queue") -> None:
    a = torchloop.loop_adapter(max_steps=MAX_STEPS, max_elements=4096, socket=sock)
    carry, xs = inputs_for(MAX_STEPS, torch.float64, seed=seed)
    final, ys = a.scan(bodies.ema, carry, xs)
    want_final, want_ys = eager.scan(bodies.ema, carry, xs)
    out.put(bool(torch.allclose(final, want_final, rtol=1e-10, atol=1e-12)
                 and torch.allclose(ys, want_ys, rtol=1e-10, atol=1e-12)))


def _compiles(sock: str) -> int:
    """Compiles of every adapter of the daemon."""
    with torchloop.Client(sock) as c:
        return sum(c.describe(a["name"])["counters"]["compiles"] for a in c.list())


def test_two_solver_processes_share_one_daemon(daemon: str, adapter) -> None:
    carry, xs = inputs_for(MAX_STEPS, torch.float64)
    adapter.scan(bodies.ema, carry, xs)  # compiled (or loaded) once, here
    before = _compiles(daemon)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_solver, args=(daemon, seed, out)) for seed in (10, 11)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [True, True]
    assert _compiles(daemon) == before  # the two processes used the same graph


def test_the_registry_finds_it_under_array_api_compat_torch(daemon: str, monkeypatch) -> None:
    import loop_ops_standin

    pkg = types.ModuleType("op_engine")
    pkg.loop_ops = loop_ops_standin
    monkeypatch.setitem(sys.modules, "op_engine", pkg)
    monkeypatch.setitem(sys.modules, "op_engine.loop_ops", loop_ops_standin)
    a = torchloop.loop_adapter(max_steps=MAX_STEPS, max_elements=4096, socket=daemon)
    assert isinstance(a, loop_ops_standin.LoopAdapter)
    loop_ops_standin.register_loop_adapter("array_api_compat.torch", a)
    namespace = types.SimpleNamespace(__name__="array_api_compat.torch")
    found = loop_ops_standin.get_loop_adapter(namespace)
    carry, xs = inputs_for(2, torch.float64)
    final, _ = found.scan(bodies.ema, carry, xs)
    torch.testing.assert_close(final, eager.scan(bodies.ema, carry, xs)[0])
    with pytest.raises(ValueError, match="must not be empty"):
        loop_ops_standin.register_loop_adapter("", a)

"""loop_adapter(eager_first=True) (torchloop/_eagerfirst.py): while the daemon
compiles a captured graph, its scans run the body in this process; once the
compile is done they go to the daemon.  Checked against the eager loop
(tests/python/eager.py) and eager autograd, float64 at 1e-10: the scans made
while compiling, the daemon's after it (its run counter moves), gradients
of the carry and of a captured tensor both ways; a graph the daemon already
has is never run eagerly; an error the daemon gives before compiling is
raised by the first scan.

Compiles: 2 (the body's forward graph and its VJP; the daemon runs on an
empty cache of its own, so that it compiles them in every run, and the
body's constant comes from a seeded generator).
"""

from __future__ import annotations

import pickle
import random
import time
from typing import Any, Callable, Iterator

import pytest
import torch

import conftest
import eager
import torchloop

N, T = 4, 3
SEED = 56


@pytest.fixture(scope="module")
def fresh_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A daemon on an empty cache of its own: nothing is compiled yet."""
    tmp = tmp_path_factory.mktemp("eager-first")
    tmp.chmod(0o755)
    cache = tmp / "cache"
    with conftest.running_daemon(tmp, "--cache-dir", str(cache)) as sock:
        yield sock


def make_body(k: float) -> tuple[Callable[..., Any], torch.Tensor]:
    w = torch.linspace(0.5, 1.5, N, dtype=torch.float64)

    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = k * c + torch.tanh(x) * w
        return new, (new * new).sum()

    return step, w


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(N, generator=g, dtype=torch.float64),
            torch.rand(T, N, generator=g, dtype=torch.float64))


def driver(adapter: Any) -> Any:
    return adapter.scan.__self__


def compiled(drv: Any, timeout: float = 900) -> None:
    """Waits until every background compile of drv has ended."""
    end = time.monotonic() + timeout
    while any(not bg.done for bg in list(drv.eager.pending.values())):
        assert time.monotonic() < end, "the background compile did not end"
        time.sleep(0.05)


def runs(client: torchloop.Client, name: str) -> float:
    return float(client.describe(name)["counters"]["runs"])


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_scans_run_eagerly_while_their_graph_compiles_then_in_the_daemon(
        fresh_daemon: str) -> None:
    k = 0.5 + random.Random(SEED).random() / 10
    body, w = make_body(k)
    ad = torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=fresh_daemon,
                                eager_first=True)
    drv = driver(ad)
    c, xs = data(1)
    want = eager.scan(body, c, xs)

    for n in (1, 2):  # the compile takes seconds: both run while it does
        got = ad.scan(body, c, xs)
        close(got[0], want[0])
        close(got[1], want[1])
        assert drv.eager.eager_scans == n
    compiled(drv)
    name = next(iter(drv.graphs))
    with torchloop.Client(fresh_daemon) as client:
        before = runs(client, name)
        got = ad.scan(body, c, xs)
        assert runs(client, name) == before + 1, "the scan after the compile ran in the daemon"
        assert drv.eager.eager_scans == 2
        close(got[0], want[0])
        close(got[1], want[1])

        # with gradients: the saved pair (the forward that keeps what the
        # backward needs, and that backward) compiles in the background the same way
        def grads() -> tuple[torch.Tensor, torch.Tensor, Any]:
            cg, wg = c.clone().requires_grad_(), w.requires_grad_()
            final, ys = ad.scan(body, cg, xs)
            (final.sum() + ys.sum()).backward()
            assert cg.grad is not None and wg.grad is not None
            out = cg.grad.clone(), wg.grad.clone(), final.detach()
            wg.grad = None
            w.requires_grad_(False)
            return out

        cg = c.clone().requires_grad_()
        w.requires_grad_()
        final, ys = eager.scan(body, cg, xs)
        (final.sum() + ys.sum()).backward()
        want_c, want_w = cg.grad, w.grad
        w.grad = None
        w.requires_grad_(False)

        gc, gw, final = grads()  # the VJP is compiling: eager autograd
        assert drv.eager.eager_scans == 3
        close(gc, want_c)
        close(gw, want_w)
        compiled(drv)
        compiles = client.describe(name)["counters"]["compiles"]
        gc, gw, final = grads()  # the daemon's forward and grad
        assert drv.eager.eager_scans == 3
        assert client.describe(name)["counters"]["compiles"] == compiles == 3, \
            "the backward found its graphs compiled"
        close(gc, want_c)
        close(gw, want_w)
        close(final, want[0])

    # another process's adapter (a pickle of this one) finds the graphs
    # compiled: nothing runs eagerly
    other = pickle.loads(pickle.dumps(ad))
    got = other.scan(body, c, xs)
    assert driver(other).eager is not None and driver(other).eager.eager_scans == 0
    close(got[0], want[0])


def test_an_error_before_any_compile_is_raised_by_the_first_scan(daemon: str) -> None:
    ad = torchloop.loop_adapter(max_steps=8, max_elements=16, socket=daemon, eager_first=True)
    big = torch.zeros(32, dtype=torch.float64)  # a carry over max_elements
    for _ in range(2):  # refused before any compile, and again: nothing ran eagerly
        with pytest.raises(torchloop.TorchloopError) as err:
            ad.scan(lambda c, x: (c + x, c), big, torch.zeros(T, 32, dtype=torch.float64))
        assert err.value.code == "TOO_MANY_ELEMENTS"
        assert driver(ad).eager.eager_scans == 0
    with pytest.raises(torchloop.TorchloopError) as err:
        ad.scan(lambda c, x: (c + x, c), big[:4], torch.zeros(T + 9, 4, dtype=torch.float64))
    assert err.value.code == "TOO_MANY_STEPS"


def test_eager_first_needs_capture() -> None:
    with pytest.raises(ValueError, match="eager_first"):
        torchloop.loop_adapter(capture=False, eager_first=True)

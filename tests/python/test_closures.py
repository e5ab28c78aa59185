"""Any number of closures of one code object on one adapter (capture.py's
shards): a solver whose method builds the scan body per configuration, over
a user RHS callback and a step size, used with 20 configurations through ONE
`loop_adapter` -- past dynamo's 8 variants per code object, where the
reference adapter (in-process torch.compile) raises FailOnRecompileLimitHit.
Each result against the eager loop; the least recently used shard dropped
past the capturer's bound, what dynamo kept for it freed, and its
configurations captured again when they return, still right.

Compiles: the configurations are ten RHS callbacks (distinct code objects,
the same formula over coefficients of their own: a new dynamo variant, the
same graph) at two step sizes (a Python float: a new graph), so 20 variants
are 2 graphs: 2 forward compiles, T = 3, a 3-element state.
"""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any, Callable

import pytest
import torch

import eager
import torchloop
from torchloop import capture

T, N = 3, 3
TOL: dict[str, Any] = dict(rtol=1e-10, atol=1e-10)
STEPS = (0.1, 0.2)


class Solver:
    """The scan body per configuration: a closure over the solver, the
    user's RHS callback and the step size (one code object for all)."""

    def __init__(self, damping: float) -> None:
        self.damping = damping

    def advance(self, rhs: Callable[[torch.Tensor], torch.Tensor], h: float) -> Callable[..., Any]:
        def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k1 = rhs(c)
            k2 = rhs(c + h * k1)  # Heun
            new = c + 0.5 * h * (k1 + k2) * self.damping + x
            return new, new.sum()
        return step


def _rhs_factory(coeffs: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def rhs(c: torch.Tensor) -> torch.Tensor:
        return torch.tanh(c) * coeffs - c
    return rhs


def make_rhs(j: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The j-th user RHS: a code object of its own (as callbacks written in
    different places are), the same formula, coefficients of its own (a live
    captured tensor: sent with each scan, not part of the graph)."""
    template = _rhs_factory(torch.zeros(N)).__code__
    coeffs = torch.linspace(-1.0, 1.0, N, dtype=torch.float64) * (j + 1) / 10
    return types.FunctionType(template.replace(co_name=f"rhs_{j}"), globals(), f"rhs_{j}",
                              None, (types.CellType(coeffs),))


RHS = [make_rhs(j) for j in range(10)]
CONFIGS = [(RHS[i // 2], STEPS[i % 2]) for i in range(20)]


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(N, dtype=torch.float64, generator=g),
            0.01 * torch.randn(T, N, dtype=torch.float64, generator=g))


def check(adapter: Any, solver: Solver, i: int) -> None:
    """Configuration i through the adapter against the eager loop."""
    rhs, h = CONFIGS[i]
    body = solver.advance(rhs, h)  # built anew per run, as the solver does
    carry, xs = data(i)
    final, ys = adapter.scan(body, carry, xs)
    want_final, want_ys = eager.scan(body, carry, xs)
    torch.testing.assert_close(final, want_final, **TOL)
    torch.testing.assert_close(ys, want_ys, **TOL)


def graphs_of(shard: Any) -> list[weakref.ref]:
    """Weak references to the StepGraphs dynamo's entries of a shard call."""
    return [weakref.ref(v) for _, run in shard.fast.entries if run is not None
            for v in run.__globals__.values() if isinstance(v, capture.StepGraph)]


@pytest.fixture
def adapter(daemon: str) -> Any:
    return torchloop.loop_adapter(max_steps=8, max_elements=4096, socket=daemon)


def test_twenty_closures_of_one_code_object_on_one_adapter(adapter: Any) -> None:
    driver = adapter.scan.__self__
    capturer = driver.capturer
    capturer.max_shards = 2  # the default (8 shards, 64 variants) made small
    solver = Solver(0.9)
    key = capture.code_key(solver.advance(RHS[0], 0.1))
    limit = torch._dynamo.config.recompile_limit
    assert limit < 12, "dynamo's limit is what this test goes past"

    for i in range(12):
        check(adapter, solver, i)
    assert capturer.captures == 12 and capturer.dropped == 0
    old, new = capturer.steps[key][1], capturer.steps[key][0]
    assert (old.captures, new.captures) == (limit, 12 - limit)
    # 12 variants, 2 graphs (one per step size): registered, compiled once each
    assert len(driver.graphs) == 2

    fast = capturer.fast_calls
    check(adapter, solver, 0)  # in the older shard: its guards pick it, no capture
    assert capturer.captures == 12 and capturer.fast_calls == fast + 1
    assert capturer.steps[key][0] is old, "the shard used last comes first"

    for i in range(12, 12 + limit - new.captures):  # the newer shard fills up
        check(adapter, solver, i)
    assert capturer.steps[key] == (new, old) and new.captures == limit
    dropped_code = old.fast.inner.__code__
    graphs = graphs_of(old)
    assert len(graphs) == limit
    gone = weakref.ref(old)
    del old
    check(adapter, solver, 16)  # a third shard: the least recently used one goes
    assert capturer.dropped == 1 and capturer.steps[key][1] is new
    gc.collect()
    # what dynamo kept for the dropped code is freed with the shard
    assert gone() is None
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(dropped_code) == []
    assert [r for r in graphs if r() is not None] == []

    captures = capturer.captures
    for i in range(3):  # dropped with their shard: captured again, still right
        check(adapter, solver, i)
    assert capturer.captures == captures + 3
    check(adapter, solver, 8)  # in the kept shard: not captured again
    assert capturer.captures == captures + 3
    assert len(driver.graphs) == 2

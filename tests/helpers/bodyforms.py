"""The body forms solvers write, for tests/python/test_capture.py and
tests/bench/capture.py: the same step (c' = 0.3 c + tanh(W x), y = c x, over
a captured W) as a closure, a lambda, a partial, a bound method of an
nn.Module, a module-level step of a user package that imports a sibling
helper, and Array-API code; and a solver that builds its RK2 step per run
inside a method, over itself and a user callback, with carry (state, None)
and inputs (times, step sizes).  The six forms capture the same graph.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import array_api_compat
import torch

N = 4
W0 = torch.randn(N, N, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
Body = Callable[..., Any]


def f(c: torch.Tensor, x: torch.Tensor, k: float, W: torch.Tensor) -> tuple[Any, Any]:
    return k * c + torch.tanh(W @ x), c * x


def source_step(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
    """The same math as a module-level function: what capture=False registers."""
    return 0.3 * c + torch.tanh(W0 @ x), c * x


def make(k: float, W: torch.Tensor) -> Body:
    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        return k * c + torch.tanh(W @ x), c * x
    return step


class Cell(torch.nn.Module):
    def __init__(self, W: torch.Tensor) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(W.detach().clone())
        self.k = 0.3

    def step(self, c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        return self.k * c + torch.tanh(self.W @ x), c * x


def xp_step_over(W: torch.Tensor) -> Body:
    def xp_step(c: torch.Tensor, x: torch.Tensor) -> tuple[Any, Any]:
        xp = array_api_compat.array_namespace(c, x)
        return 0.3 * c + xp.tanh(W @ x), xp.multiply(c, x)
    return xp_step


def package_step(tmp: Path, W: torch.Tensor) -> Body:
    """A module-level step of a user package that imports a sibling helper."""
    pkg = tmp / "mysolver"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "physics.py").write_text("import torch\n\ndef flux(W, x):\n    return torch.tanh(W @ x)\n")
    (pkg / "core.py").write_text(textwrap.dedent("""\
        from mysolver.physics import flux
        K = 0.3
        W = None

        def step(c, x):
            return K * c + flux(W, x), c * x
        """))
    if str(tmp) not in sys.path:
        sys.path.insert(0, str(tmp))
    import mysolver.core  # type: ignore[import-not-found]

    mysolver.core.W = W
    return mysolver.core.step


FORMS = ("closure", "lambda", "partial", "bound method of an nn.Module", "package helper",
         "array api")


def form(name: str, tmp: Path) -> tuple[Body, torch.Tensor]:
    """(body, the tensor it captures, requiring grad) of one form."""
    W = W0.clone().requires_grad_()
    if name == "closure":
        return make(0.3, W), W
    if name == "lambda":
        return (lambda c, x: f(c, x, 0.3, W)), W
    if name == "partial":
        return functools.partial(f, k=0.3, W=W), W
    if name == "bound method of an nn.Module":
        cell = Cell(W0)
        return cell.step, cell.W
    if name == "package helper":
        return package_step(tmp, W), W
    if name == "array api":
        return xp_step_over(W), W
    raise KeyError(name)


class Solver:
    """What Array-API solver libraries do: the step is built inside a method,
    per run, over the solver object, the user's callback and the run's data."""

    def __init__(self, rhs: Callable[..., Any], decay: float) -> None:
        self.rhs, self.decay = rhs, decay

    def run(self, scan: Callable[..., Any], y0: torch.Tensor, times: torch.Tensor,
            dts: torch.Tensor, forcing: torch.Tensor) -> tuple[Any, Any]:
        def step(carry: Any, x: Any) -> tuple[Any, Any]:
            state, _ = carry
            t, h = x
            xp = array_api_compat.array_namespace(state)
            k1 = self.rhs(t, state, forcing) - self.decay * state
            mid = state + 0.5 * h * k1
            k2 = self.rhs(t + 0.5 * h, mid, forcing) - self.decay * mid
            new = state + h * k2
            return (new, None), xp.sum(new * new)

        return scan(step, (y0, None), (times, dts))


def rhs(t: torch.Tensor, y: torch.Tensor, forcing: torch.Tensor) -> torch.Tensor:
    return torch.sin(t) * forcing - y * y


FORCING = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def solver_source_step(carry: Any, x: Any) -> tuple[Any, Any]:
    """The solver's RK2 step (decay 0.25, over FORCING) as a module-level body
    with the same trees, for capture=False: the path before capture."""
    state, _ = carry
    t, h = x
    k1 = rhs(t, state, FORCING) - 0.25 * state
    mid = state + 0.5 * h * k1
    k2 = rhs(t + 0.5 * h, mid, FORCING) - 0.25 * mid
    new = state + h * k2
    return (new, None), torch.sum(new * new)


def solver_inputs(seed: int, steps: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.rand(N, generator=gen, dtype=torch.float64, requires_grad=True)
    times = torch.linspace(0, 1, steps, dtype=torch.float64)
    dts = torch.full((steps,), 0.1, dtype=torch.float64)
    forcing = torch.rand(N, generator=gen, dtype=torch.float64, requires_grad=True)
    return y0, times, dts, forcing


def inputs(seed: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(N, generator=gen, dtype=torch.float64, requires_grad=True),
            torch.rand(steps, N, generator=gen, dtype=torch.float64, requires_grad=True))

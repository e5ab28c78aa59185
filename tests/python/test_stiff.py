"""Stiff solvers through the daemon (issue 54): steps with linear solves.

An Array-API solver's stiff methods, as such a library writes them: the
solver object builds its step per run, a closure over itself, the user's
RHS and Jacobian callbacks and the step size; the carry is (state, None),
the inputs a tuple of 1-D tensors; the step calls `xp.*` (array_api_compat's
torch namespace) and `torch.linalg`.  The problem is a 1-D reaction-
diffusion on an 8-point grid (stiff: the diffusion's eigenvalues reach
-4D/dx^2), whose diffusion coefficient and reaction rate are tensors the
callbacks capture (live: sent with each scan, gradients reach them).

- implicit Euler: one Newton step, `xp.linalg.solve(I - h J(y), h f(y))`;
- Rosenbrock (ROS2, gamma = 1 + 1/sqrt 2): one `torch.linalg.lu_factor` of
  W = I - gamma h J and two `lu_solve`s;
- IMEX Euler: the diffusion implicit (`xp.linalg.solve`), the reaction and
  the source explicit.

Each against the same closure run by the eager loop (eager.py): values at
rtol 1e-12 (float64) / 1e-5 (float32), gradients w.r.t. the initial state
and the captured diffusion coefficient against eager autograd.  A singular
system raises eager's torch.linalg.LinAlgError with eager's message (the
package runs export's error check on each step's info, _checks.py), and
the daemon serves the next scan.

Compiles (the session daemon, the run's cache): 3 methods x float64 T=7
with gradients (a saved pair each: 6), float32 T=7 (3), float64 T=1 and
T=64 (6), two singular configurations (2): 17.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import array_api_compat.torch as xp
import pytest
import torch

import eager
import torchloop

N = 8  # grid points
METHODS = ("implicit_euler", "rosenbrock", "imex_euler")
Fn = Callable[[torch.Tensor], torch.Tensor]


def laplacian(n: int, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D Laplacian with Dirichlet ends, dx = 1/(n+1)."""
    dx2 = (1.0 / (n + 1)) ** 2
    return (torch.diag(torch.full((n - 1,), 1.0, dtype=dtype), 1)
            + torch.diag(torch.full((n - 1,), 1.0, dtype=dtype), -1)
            - 2 * torch.eye(n, dtype=dtype)) / dx2


class Problem:
    """The user's callbacks: f(y) = D L y - k y^3 and its Jacobian."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.L = laplacian(N, dtype)
        self.D = torch.tensor(0.05, dtype=dtype)
        self.k = torch.tensor(2.0, dtype=dtype)

    def rhs(self) -> Fn:
        L, D, k = self.L, self.D, self.k
        return lambda y: D * (L @ y) - k * y**3

    def jac(self) -> Fn:
        L, D, k = self.L, self.D, self.k
        return lambda y: D * L - torch.diag(3 * k * y**2)

    def diffusion(self) -> torch.Tensor:
        return self.D * self.L

    def reaction(self) -> Fn:
        k = self.k
        return lambda y: -k * y**3


class StiffSolver:
    """The solver object: `advance` builds a method's step per run."""

    def __init__(self, problem: Problem, method: str, h: float) -> None:
        self.problem, self.method, self.h = problem, method, h

    def advance(self) -> Callable[..., Any]:
        return getattr(self, self.method)()

    def implicit_euler(self) -> Callable[..., Any]:
        f, J, h = self.problem.rhs(), self.problem.jac(), self.h

        def step(carry: tuple[torch.Tensor, None], x: tuple[torch.Tensor, torch.Tensor]):
            y, _ = carry
            source, _t = x
            eye = xp.eye(y.shape[0], dtype=y.dtype)
            dy = xp.linalg.solve(eye - h * J(y), h * (f(y) + source))
            y1 = y + dy
            return (y1, None), xp.sum(y1)
        return step

    def rosenbrock(self) -> Callable[..., Any]:
        f, J, h = self.problem.rhs(), self.problem.jac(), self.h
        gamma = 1.0 + 1.0 / math.sqrt(2.0)

        def step(carry: tuple[torch.Tensor, None], x: tuple[torch.Tensor, torch.Tensor]):
            y, _ = carry
            source, _t = x
            W = xp.eye(y.shape[0], dtype=y.dtype) - gamma * h * J(y)
            LU, piv = torch.linalg.lu_factor(W)
            k1 = torch.linalg.lu_solve(LU, piv, (f(y) + source)[:, None])[:, 0]
            k2 = torch.linalg.lu_solve(LU, piv, (f(y + h * k1) + source - 2 * k1)[:, None])[:, 0]
            y1 = y + 1.5 * h * k1 + 0.5 * h * k2
            return (y1, None), (xp.sum(y1), y1[0])
        return step

    def imex_euler(self) -> Callable[..., Any]:
        A, r, h = self.problem.diffusion(), self.problem.reaction(), self.h

        def step(carry: tuple[torch.Tensor, None], x: tuple[torch.Tensor, torch.Tensor]):
            y, _ = carry
            source, t = x
            lhs = xp.eye(y.shape[0], dtype=y.dtype) - h * A
            y1 = xp.linalg.solve(lhs, y + h * (r(y) + source * xp.cos(t)))
            return (y1, None), y1
        return step


def inputs(steps: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(steps)
    return (torch.rand(steps, generator=g, dtype=torch.float64).to(dtype),
            torch.linspace(0.0, 1.0, steps, dtype=dtype))


def initial(dtype: torch.dtype) -> torch.Tensor:
    return torch.sin(torch.linspace(0.1, 3.0, N, dtype=torch.float64)).to(dtype)


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def adapter(daemon: str) -> Any:
    """One adapter for every method and configuration (one code object per
    method, a new closure per run)."""
    return torchloop.loop_adapter(max_steps=64, max_elements=1 << 12, socket=daemon)


def assert_tree_close(got: Any, want: Any, **kw: float) -> None:
    for g, w in zip(eager.leaves(got), eager.leaves(want)):
        torch.testing.assert_close(g, w, **kw)


@pytest.mark.parametrize("method", METHODS)
def test_float64_values_and_gradients_match_eager(adapter: Any, method: str) -> None:
    """T = 7, float64: values and the gradients w.r.t. the initial state and
    the diffusion coefficient the RHS captures, against eager autograd."""
    got_grads, want_grads, results = [], [], []
    for run in (adapter.scan, eager.scan):
        problem = Problem(torch.float64)
        problem.D.requires_grad_(True)
        y0 = initial(torch.float64).requires_grad_(True)
        body = StiffSolver(problem, method, 0.05).advance()
        (y, none), ys = run(body, (y0, None), inputs(7, torch.float64))
        assert none is None
        loss = y.square().sum() + sum(t.sum() for t in eager.leaves(ys))
        (got_grads if run is adapter.scan else want_grads).extend(
            torch.autograd.grad(loss, (y0, problem.D)))
        results.append((y.detach(), eager.tree_map(torch.Tensor.detach, ys)))
    assert_tree_close(results[0], results[1], **tol(torch.float64))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
def test_float32_values_match_eager(adapter: Any, method: str) -> None:
    body = StiffSolver(Problem(torch.float32), method, 0.05).advance()
    carry, xs = (initial(torch.float32), None), inputs(7, torch.float32)
    assert_tree_close(adapter.scan(body, carry, xs), eager.scan(body, carry, xs),
                      **tol(torch.float32))


@pytest.mark.parametrize("steps", [1, 64])
@pytest.mark.parametrize("method", METHODS)
def test_one_step_and_the_longest_scan_match_eager(adapter: Any, method: str, steps: int) -> None:
    body = StiffSolver(Problem(torch.float64), method, 0.02).advance()
    carry, xs = (initial(torch.float64), None), inputs(steps, torch.float64)
    assert_tree_close(adapter.scan(body, carry, xs), eager.scan(body, carry, xs),
                      **tol(torch.float64))


class SwitchSolver(StiffSolver):
    """The step's matrix is (1 - t) I for implicit Euler (W for Rosenbrock):
    singular where the input t is 1."""

    def implicit_euler(self) -> Callable[..., Any]:
        h = self.h

        def step(carry: tuple[torch.Tensor, None], x: tuple[torch.Tensor, torch.Tensor]):
            y, _ = carry
            _source, t = x
            A = xp.eye(y.shape[0], dtype=y.dtype) * (1 - t)
            return (y + xp.linalg.solve(A, h * y), None), xp.sum(y)
        return step

    def rosenbrock(self) -> Callable[..., Any]:
        h = self.h

        def step(carry: tuple[torch.Tensor, None], x: tuple[torch.Tensor, torch.Tensor]):
            y, _ = carry
            _source, t = x
            eye = xp.eye(y.shape[0], dtype=y.dtype)
            W = eye - torch.diag(torch.where(xp.arange(y.shape[0]) == 2, t, 0 * t))
            LU, piv = torch.linalg.lu_factor(W)
            k1 = torch.linalg.lu_solve(LU, piv, y[:, None])[:, 0]
            return (y + h * k1, None), xp.sum(k1)
        return step


@pytest.mark.parametrize("method", ["implicit_euler", "rosenbrock"])
def test_a_singular_system_raises_eagers_linalg_error_and_the_daemon_serves_on(
        adapter: Any, method: str) -> None:
    """t = 1 at step 3: eager raises there (solve: LinAlgError 'the input
    matrix is singular'; lu_factor: a RuntimeError naming the zero pivot,
    U[3,3]: the info value reaches the message); the package raises the
    same type with the same message, and a scan of a regular system
    (t < 1) on the same graph comes back equal to eager."""
    body = SwitchSolver(Problem(torch.float64), method, 0.05).advance()
    y0 = initial(torch.float64)
    t = torch.tensor([0.0, 0.2, 0.4, 1.0, 0.3, 0.1, 0.0], dtype=torch.float64)
    xs = (torch.zeros(7, dtype=torch.float64), t)
    with pytest.raises(RuntimeError) as want:
        eager.scan(body, (y0, None), xs)
    with pytest.raises(RuntimeError) as got:
        adapter.scan(body, (y0, None), xs)
    # solve's is a LinAlgError; lu_factor's check raises a plain RuntimeError
    assert type(want.value) is (torch.linalg.LinAlgError if method == "implicit_euler"
                                else RuntimeError)
    assert type(got.value) is type(want.value)
    assert str(got.value) == str(want.value)
    ok = (xs[0], t * 0.5)
    assert_tree_close(adapter.scan(body, (y0, None), ok), eager.scan(body, (y0, None), ok),
                      **tol(torch.float64))

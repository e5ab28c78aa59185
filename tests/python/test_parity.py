"""The compile worker's parity check (daemon/worker/torchloop_worker/parity.py:
parity_mismatch, parity_check) cannot refuse a correct graph.

The comparison is tested by hand-written values; end to end, a body whose
values overflow on the worker's random inputs in [0, 1) but not on the
user's (c * exp(100 dt), dt = 1e-3: the eager loop gives finite numbers)
compiles, runs and matches eager, float32 and float64, as does a Van der Pol
RK4 step (mu = 5) whose state blows up to inf and NaN on random step sizes.  The deliberately
miscompiled graph that must still be refused is tests/e2e/test_compile_path.c
(an_artifact_that_disagrees_with_the_eager_scan_is_refused).

Compiles: three (T = 16: one per dtype, and the Van der Pol step).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import torchloop

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
from torchloop_worker import parity  # noqa: E402

INF, NAN = float("inf"), float("nan")
F64 = torch.float64


def mismatch(got: list[float], want: list[float], random: bool = False):
    return parity.parity_mismatch(torch.tensor(got, dtype=F64), torch.tensor(want, dtype=F64),
                             1e-6, random)


def test_the_same_infinity_or_nan_on_both_sides_agrees():
    assert mismatch([INF, -INF, NAN, 1.0], [INF, -INF, NAN, 1.0]) is None


def test_a_finite_difference_beyond_the_tolerance_is_refused_with_where_and_how_much():
    err, at, scale = mismatch([1.0, 2.5, 3.0], [1.0, 2.0, 3.0])
    assert (err, at, scale) == (0.5, 1, 3.0)


def test_infinities_do_not_set_the_scale():
    # max |eager| over the finite elements is 1, not inf: 1e-3 is off by 1e-3 relative
    err, at, scale = mismatch([INF, 1.001], [INF, 1.0])
    assert at == 1 and scale == 1.0 and err == pytest.approx(1e-3)


@pytest.mark.parametrize("got,want", [([INF], [1.0]), ([NAN], [1.0]), ([1.0], [INF]),
                                      ([-INF], [INF]), ([INF], [NAN])])
def test_on_the_users_inputs_every_non_finite_disagreement_is_refused(got, want):
    err, at, _ = mismatch(got, want)
    assert err == INF and at == 0


@pytest.mark.parametrize("got,want", [([1.0, 2.0], [INF, 2.0]), ([INF, 2.0], [NAN, 2.0])])
def test_on_random_inputs_an_element_eager_cannot_compute_is_skipped(got, want):
    assert mismatch(got, want, random=True) is None


def test_on_random_inputs_a_finite_eager_element_is_still_checked():
    err, at, _ = mismatch([INF, 5.0], [INF, 2.0], random=True)
    assert (err, at) == (3.0, 1)


def overflowing(c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    c = c * torch.exp(100 * dt)
    return c, c


def eager_loop(c: torch.Tensor, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ys = []
    for t in range(xs.shape[0]):
        c, y = overflowing(c, xs[t])
        ys.append(y)
    return c, torch.stack(ys)


def logistic(x: torch.Tensor, r: float, steps: int) -> torch.Tensor:
    """A chaotic map (r = 3.99) or a stable one (r = 2.5), every step kept."""
    out = []
    for _ in range(steps):
        x = r * x * (1 - x)
        out.append(x)
    return torch.stack(out)


class FakeRunner:
    """Stands for the artifact: returns the given results."""

    results: list[torch.Tensor] = []

    def __init__(self, so_path: str, threads: int) -> None:
        pass

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.results


@pytest.mark.parametrize("r, wrong, passes", [
    (3.99, False, True),  # rounding grown to O(1) by chaos: inconclusive, not refused
    (2.5, False, True),  # stable: rounding stays rounding
    (2.5, True, False),  # stable and wrong: refused
    (3.99, True, False),  # wrong from the first step, where the map is still stable
])
def test_on_random_inputs_a_disagreement_within_the_eager_scans_own_sensitivity_passes(
        monkeypatch: pytest.MonkeyPatch, r: float, wrong: bool, passes: bool) -> None:
    """128 steps of the logistic map on random inputs: the "compiled"
    results are eager's at inputs one ulp away (what a reordered sum does),
    or eager's scaled by 1.01 (a miscompile)."""
    x = torch.rand(8, dtype=F64, generator=torch.Generator().manual_seed(3))
    want = [logistic(x, r, 128)]
    got = logistic(x * (1 + torch.finfo(F64).eps), r, 128)
    if wrong:
        got = got * 1.01
    FakeRunner.results = [got]
    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCpu", FakeRunner)
    notes: list[str] = []
    def reference(args: list[torch.Tensor]) -> list[torch.Tensor]:
        return [logistic(args[0], r, 128)]
    run = lambda: parity.parity_check("fake.so", [(0, (x,), want)], "float64", ["outputs"],
                                      True, reference, 1, notes)
    if passes:
        run()
        assert bool(notes) == (r > 3), notes  # the chaotic case says it was inconclusive
    else:
        with pytest.raises(parity.JobError) as info:
            run()
        assert info.value.code == "MISCOMPILE"
    # without the reference (the user's own inputs) the chaotic case is refused
    if r > 3 and not wrong:
        with pytest.raises(parity.JobError):
            parity.parity_check("fake.so", [(0, (x,), want)], "float64", ["outputs"], False)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_a_body_that_overflows_on_random_inputs_compiles_and_matches_eager(daemon, dtype, tol):
    adapter = torchloop.loop_adapter(max_steps=16, max_elements=64, socket=daemon)
    c0 = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    dts = torch.full((16,), 1e-3, dtype=dtype)
    final, ys = adapter.scan(overflowing, c0, dts)
    want_final, want_ys = eager_loop(c0, dts)
    assert torch.isfinite(want_ys).all()
    torch.testing.assert_close(final, want_final, rtol=tol, atol=0)
    torch.testing.assert_close(ys, want_ys, rtol=tol, atol=0)
    # on the worker's random inputs the same loop is infinite: what used to fail
    rand = torch.rand(16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    assert not torch.isfinite(eager_loop(c0, rand)[0]).all()


MU = 5.0


def vdp_rk4(c: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def f(s: torch.Tensor) -> torch.Tensor:
        return torch.stack([s[1], MU * (1 - s[0] * s[0]) * s[1] - s[0]])

    k1 = f(c)
    k2 = f(c + dt / 2 * k1)
    k3 = f(c + dt / 2 * k2)
    k4 = f(c + dt * k3)
    c = c + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return c, c


def test_a_van_der_pol_rk4_step_that_blows_up_on_random_step_sizes_compiles(daemon):
    adapter = torchloop.loop_adapter(max_steps=16, max_elements=64, socket=daemon)
    c0 = torch.tensor([2.0, 0.0], dtype=F64)
    dts = torch.full((16,), 0.01, dtype=F64)
    final, ys = adapter.scan(vdp_rk4, c0, dts)
    c, want = c0, []
    for t in range(16):
        c, y = vdp_rk4(c, dts[t])
        want.append(y)
    torch.testing.assert_close(final, c, rtol=1e-12, atol=0)
    torch.testing.assert_close(ys, torch.stack(want), rtol=1e-12, atol=0)
    # what the worker's random inputs in [0, 1) make of it
    gen = torch.Generator().manual_seed(0)
    c = torch.rand(2, dtype=F64, generator=gen)
    for dt in torch.rand(16, dtype=F64, generator=gen):
        c, _ = vdp_rk4(c, dt)
    assert not torch.isfinite(c).all()


def test_a_final_carry_no_run_reproduces_is_not_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stiff bench's case: 128 chaotic steps to a final carry (not
    stacked) that a one-ulp move takes anywhere on the attractor: the
    compiled value is not compared (inconclusive, said in the notes); a
    stable final carry that is wrong is still refused."""
    x = torch.rand(8, dtype=F64, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCpu", FakeRunner)
    for r, passes in ((3.99, True), (2.5, False)):
        want = [logistic(x, r, 128)[-1]]
        FakeRunner.results = [logistic(x * (1 + 4 * torch.finfo(F64).eps), r, 128)[-1] * 1.01]
        notes: list[str] = []
        run = lambda: parity.parity_check(
            "fake.so", [(0, (x,), want)], "float64", ["carry"], True,
            lambda args: [logistic(args[0], r, 128)[-1]], 1, notes)
        if passes:
            run()
            assert notes and "inconclusive" in notes[0]
        else:
            with pytest.raises(parity.JobError):
                run()

"""The parity check: each new artifact run once on the request's inputs (or
random ones) against the eager scan; a disagreement refuses it (MISCOMPILE).

On random inputs (a captured graph's: compile.use_sample) the eager scan may
itself be unstable where the user's inputs never are: a stiff solve over a
random, near-singular matrix, a chaotic map over 128 steps, where rounding
differences of 1e-16 grow to O(1).  So a disagreement on random inputs is a
verdict only beyond the eager scan's own sensitivity: the eager scan again
at inputs moved by SENSITIVITY_ULPS ulps (relative, a fixed pattern), and
each element may differ from eager by what that move moved it (per step,
its running maximum, for stacked outputs), or by anything where the move
alone moved eager by over UNSTABLE of its scale (a value no run reproduces;
the note says the check was inconclusive there).  The stiff bench's
implicit Euler on random near-singular matrices moved by 358 of 367 for a
one-ulp move.  A miscompile that gives a
wrong value at the first step of such a graph still shows where the eager
scan is stable; in a chaotic graph on random inputs no check can tell."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch

from .errors import JobError
from .job import KINDS
from .lowering import cotangents, vjp_module
from .scan import Scan
from .specs import spec_leaves

# One parity case: (batch size or 0, the graph's data inputs, the eager results).
Case = tuple[int, tuple[torch.Tensor, ...], list[torch.Tensor]]
# The eager results at other values of the scan's inputs (eager_reference).
Reference = Callable[[list[torch.Tensor]], list[torch.Tensor]]
SENSITIVITY_ULPS = 1024
UNSTABLE = 1e-2  # a move of SENSITIVITY_ULPS ulps moving a result this much of its scale

# Artifacts this process has loaded (each parity check loads one; the worker
# asks to be replaced after RECYCLE_AFTER of them, compile_worker.py).
artifacts_loaded = [0]


def example_inputs(scan: Scan, sample: list[bytes] | None = None) -> list[torch.Tensor]:
    """The dry run's (and parity check's) inputs: the requesting scan's own
    when the daemon sent them, else uniform in [0, 1)."""
    dtype = getattr(torch, scan.dtype)
    shapes = spec_leaves(scan.carry_spec) + spec_leaves(scan.inputs_spec)
    if sample is not None:
        return sample_inputs(sample, shapes, dtype)
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(s, dtype=dtype, generator=gen) for s in shapes]


def sample_inputs(sample: list[bytes], shapes: list[list[int]],
                  dtype: torch.dtype) -> list[torch.Tensor]:
    if len(sample) != len(shapes):
        raise JobError("COMPILE_FAILED", f"malformed job from the daemon: {len(sample)} "
                       f"sample leaves for {len(shapes)} tensors")
    out = []
    size = torch.empty((), dtype=dtype).element_size()
    for b, shape in zip(sample, shapes):
        if len(b) != math.prod(shape) * size:
            raise JobError("COMPILE_FAILED", "malformed job from the daemon: a sample leaf "
                           f"of {len(b)} bytes for shape {shape}")
        t = torch.frombuffer(bytearray(b), dtype=dtype) if b else torch.empty(0, dtype=dtype)
        out.append(t.reshape(shape))
    return out


# The parity check's tolerance: norm-wise, max |compiled - eager| / max |eager|
# per output (the test suites' float64 bound; float32 rounds 2^29 times coarser).
PARITY_RTOL = {"float64": 1e-6, "float32": 1e-3}


def parity_reference(scan: Scan, args: list[torch.Tensor], outs: tuple[torch.Tensor, ...],
                     kind: str) -> list[torch.Tensor]:
    """What the artifact must compute, eagerly and without the tracer: the dry
    run's outputs, and for a VJP graph torch.func.vjp of the unrolled loop."""
    if not KINDS[kind]:
        return list(outs)
    dry = replace(scan, strategy="unroll", tracing=False)
    return list(vjp_module(dry, len(args))(*args, *cotangents(outs)))


def eager_reference(scan: Scan, kind: str) -> Reference:
    """The eager scan's results (parity_reference's) at given inputs."""
    def reference(args: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            outs = replace(scan, strategy="unroll", tracing=False).forward(*args)
        return parity_reference(scan, args, outs, kind)
    return reference


def sensitivity(inputs: list[torch.Tensor], want: list[torch.Tensor], names: list[str],
                reference: Reference) -> list[torch.Tensor]:
    """How far each result may be from eager's: |eager at inputs moved by
    SENSITIVITY_ULPS ulps - eager at inputs| (0 where either is not
    finite), as its largest value so far along the steps for a stacked
    output (chaos grows with the steps; one move's difference at one element
    can be small by chance), its largest value for the others."""
    moved = []
    for i, t in enumerate(inputs):
        ulp = torch.finfo(t.dtype).eps * SENSITIVITY_ULPS
        sign = (torch.arange(t.numel()).reshape(t.shape) + i) % 2 * 2 - 1
        moved.append(t * (1 + ulp * sign.to(t.dtype)))
    allow = []
    for a, w, name in zip(reference(moved), want, names):
        d = (a.double() - w.double()).abs().nan_to_num(nan=0.0, posinf=0.0)
        if name == "outputs" and d.ndim >= 1 and d.numel():
            per_step = d.reshape(d.shape[0], -1).amax(1).cummax(0).values
            d = per_step.reshape([-1] + [1] * (d.ndim - 1)).expand(d.shape)
        else:
            d = torch.full_like(d, float(d.max()) if d.numel() else 0.0)
        # where the move alone took eager over UNSTABLE of its scale, its
        # value is not reproducible at all (chaos): nothing to compare
        finite = w[torch.isfinite(w)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        allow.append(torch.where(d > UNSTABLE * scale, torch.full_like(d, math.inf), d))
    return allow


def parity_mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float,
                    skip_nonfinite: bool, allow: torch.Tensor | None = None
                    ) -> tuple[float, int, float] | None:
    """(max |got - want|, its flat index, max |want|) when got disagrees with
    want beyond rtol (norm-wise), else None.  Elements that are equal (the
    same infinity included) or NaN on both sides agree; with skip_nonfinite
    (random inputs, which may overflow where the user's never do) an element
    whose eager value is not finite is not checked at all."""
    g = got.detach().to(torch.float64).reshape(-1)
    w = want.detach().to(torch.float64).reshape(-1)
    if w.numel() == 0:
        return None
    finite = torch.isfinite(w)
    agree = (g == w) | (torch.isnan(g) & torch.isnan(w))
    if skip_nonfinite:
        agree |= ~finite
    inf = float("inf")
    diff = torch.where(agree, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=inf, posinf=inf))
    if allow is not None:  # what the eager scan's own sensitivity allows
        diff = (diff - allow.reshape(-1)).clamp_min(0.0)
    scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
    err = float(diff.max())
    if err <= rtol * max(scale, 1e-30):
        return None
    return err, int(diff.argmax()), scale


def parity_check(so_path: str, cases: list[Case], dtype: str, names: list[str],
                 random: bool, reference: Reference | None = None, n_args: int = 0,
                 notes: list[str] | None = None) -> None:
    """Runs the new artifact on each case's inputs (its results land in fresh
    buffers) and refuses it with MISCOMPILE if any output disagrees with the
    eager reference beyond PARITY_RTOL (parity_mismatch). A case is (batch
    size or 0, the graph's data inputs, the eager results); a symbolic-batch
    graph is checked at its probe size and at batch size 1.  random: the
    inputs are random ones, not the requesting scan's; names: each result's
    name, for the messages.  reference (random inputs, batch size 0): the
    eager results at other inputs, for the eager scan's own sensitivity
    (the module's docstring), over the first n_args data inputs; notes gets
    a line when that decided."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so_path, 1)
    artifacts_loaded[0] += 1
    for batch, inputs, want in cases:
        bufs = [torch.full(w.shape, float("nan"), dtype=w.dtype) for w in want]
        got = runner.run([t.clone() for t in inputs] + bufs)
        allow: list[torch.Tensor] | None = None
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape:
                raise JobError("MISCOMPILE", f"output {i} ({names[i]}) has shape "
                               f"{list(g.shape)}{f' at batch size {batch}' if batch else ''}, "
                               f"the eager scan {list(w.shape)}")
            bad = parity_mismatch(g, w, PARITY_RTOL[dtype], random)
            if bad is not None and random and reference is not None and not batch:
                if allow is None:
                    allow = sensitivity(list(inputs[:n_args]), want, names, reference)
                if len(allow) == len(want) and \
                        parity_mismatch(g, w, PARITY_RTOL[dtype], random, allow[i]) is None:
                    if notes is not None:
                        notes.append(f"parity on random inputs inconclusive for output {i} "
                                     f"({names[i]}): the eager scan itself moves by up to "
                                     f"{float(allow[i].max()):.3g} when its inputs move by "
                                     f"{SENSITIVITY_ULPS} ulps; the compiled graph is within that")
                    continue
            if bad is not None:
                raise _mismatch(bad, g, w, i, names[i], batch, random, dtype)
    del runner


def _mismatch(bad: tuple[float, int, float], g: torch.Tensor, w: torch.Tensor, i: int,
              name: str, batch: int, random: bool, dtype: str) -> JobError:
    err, at, scale = bad
    where = f" at batch size {batch}" if batch else ""
    on = "random inputs (uniform in [0, 1))" if random else "the request's own inputs"
    return JobError(
        "MISCOMPILE",
        f"the compiled graph disagrees with the eager scan on output {i} "
        f"({name}){where}, run on {on}: max |compiled - eager| = {err:.3g} at "
        f"flat index {at} (compiled {float(g.reshape(-1)[at]):.17g}, eager "
        f"{float(w.reshape(-1)[at]):.17g}) against max |eager| = {scale:.3g}; "
        f"tolerance {PARITY_RTOL[dtype]:g} relative. Nothing was cached.",
        name)



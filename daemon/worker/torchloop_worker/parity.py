"""The parity check: each new artifact run once on the request's inputs (or
random ones) against the eager scan; a disagreement refuses it (MISCOMPILE)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .errors import JobError
from .job import KINDS
from .lowering import cotangents, vjp_module
from .scan import Scan
from .specs import spec_leaves

# One parity case: (batch size or 0, the graph's data inputs, the eager results).
Case = tuple[int, tuple[torch.Tensor, ...], list[torch.Tensor]]

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


def parity_mismatch(got: torch.Tensor, want: torch.Tensor, rtol: float,
                    skip_nonfinite: bool) -> tuple[float, int, float] | None:
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
    scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
    err = float(diff.max())
    if err <= rtol * max(scale, 1e-30):
        return None
    return err, int(diff.argmax()), scale


def parity_check(so_path: str, cases: list[Case], dtype: str, names: list[str],
                 random: bool) -> None:
    """Runs the new artifact on each case's inputs (its results land in fresh
    buffers) and refuses it with MISCOMPILE if any output disagrees with the
    eager reference beyond PARITY_RTOL (parity_mismatch). A case is (batch
    size or 0, the graph's data inputs, the eager results); a symbolic-batch
    graph is checked at its probe size and at batch size 1.  random: the
    inputs are random ones, not the requesting scan's; names: each result's
    name, for the messages."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so_path, 1)
    artifacts_loaded[0] += 1
    on = "random inputs (uniform in [0, 1))" if random else "the request's own inputs"
    for batch, inputs, want in cases:
        bufs = [torch.full(w.shape, float("nan"), dtype=w.dtype) for w in want]
        got = runner.run([t.clone() for t in inputs] + bufs)
        where = f" at batch size {batch}" if batch else ""
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape:
                raise JobError("MISCOMPILE", f"output {i} ({names[i]}) has shape "
                               f"{list(g.shape)}{where}, the eager scan {list(w.shape)}")
            bad = parity_mismatch(g, w, PARITY_RTOL[dtype], random)
            if bad is None:
                continue
            err, at, scale = bad
            raise JobError(
                "MISCOMPILE",
                f"the compiled graph disagrees with the eager scan on output {i} "
                f"({names[i]}){where}, run on {on}: max |compiled - eager| = {err:.3g} at "
                f"flat index {at} (compiled {float(g.reshape(-1)[at]):.17g}, eager "
                f"{float(w.reshape(-1)[at]):.17g}) against max |eager| = {scale:.3g}; "
                f"tolerance {PARITY_RTOL[dtype]:g} relative. Nothing was cached.",
                names[i])
    del runner



"""Lowering a Scan to the graph AOTInductor compiles: torch.export of the
flat scan (forward), make_fx of its VJP then export (vjp), the checkpointed
VJP (checkpoint.py); with a symbolic batch dimension for dynamic = batch;
wrapped in the daemon's calling convention (OutModule: results written into
buffers passed after the inputs)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from . import checkpoint
from .errors import JobError, classify
from .frames import log
from .job import KINDS
from .scan import Scan, captured_tensors
from .specs import BATCH, Spec, spec_leaves

Tensors = tuple[torch.Tensor, ...]
# a function over flat tensors: what make_fx traces, what a module wraps
Flat = Callable[..., Tensors]
# torch.export's dynamic_shapes for a module taking *flat
DynamicShapes = tuple[tuple[dict[int, torch.export.Dim] | None, ...]]


def vjp_module(scan: Scan, n_in: int) -> Flat:
    """forward + VJP over the flat scan, traced with make_fx (first order)."""
    from torch.func import vjp

    def fn(*args: torch.Tensor) -> Tensors:
        primals, cotangents = args[:n_in], args[n_in:]
        outs, pullback = vjp(lambda *p: scan.forward(*p), *primals)[:2]
        grads = pullback(tuple(cotangents))
        return tuple(outs) + tuple(grads)

    return fn


def vjp_module_autograd(scan: Scan, n_in: int, n_lifted: int = 0) -> Flat:
    """forward + VJP with torch.autograd.grad, for strategy "scan": torch.func.vjp
    cannot trace through the scan op (it refuses functorch transforms of the
    compiled function), but the scan op has an autograd formula (a reversed scan)
    that make_fx records. The body's captured tensors come last (n_lifted of
    them), so make_fx sees them as inputs, not as real tensors inside a fake
    trace."""

    def fn(*args: torch.Tensor) -> Tensors:
        primals = [a.detach().requires_grad_(True) for a in args[:n_in]]
        cotangents = args[n_in : len(args) - n_lifted]
        lifted = list(args[len(args) - n_lifted :]) if n_lifted else None
        with torch.enable_grad():
            outs = scan.forward(*primals, lifted=lifted)
            pairs = [(o, g) for o, g in zip(outs, cotangents) if o.requires_grad]
            grads: Sequence[torch.Tensor | None] = torch.autograd.grad(
                [o for o, _ in pairs], primals, [g for _, g in pairs], allow_unused=True
            ) if pairs else [None] * n_in
        full = [torch.zeros_like(p) if g is None else g for p, g in zip(primals, grads)]
        return tuple(o.detach() for o in outs) + tuple(full)

    return fn


def cotangents(outs: Tensors) -> list[torch.Tensor]:
    """The VJP graph's example cotangents (also the parity check's)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(o.shape, dtype=o.dtype, generator=gen) for o in outs]


@dataclass
class BatchDims:
    """The symbolic batch of a dynamic = batch graph: which dimension of each
    of its flat tensors is the batch size (-1 in these shapes)."""

    dim: torch.export.Dim
    inputs: list[list[int]]  # data inputs (cotangents included)
    results: list[list[int]]  # results, which are also its out buffers

    def spec(self, shapes: list[list[int]]) -> tuple[dict[int, torch.export.Dim] | None, ...]:
        return tuple({i: self.dim for i, d in enumerate(s) if d == BATCH} or None
                     for s in shapes)

    def of(self, shapes: list[list[int]]) -> DynamicShapes:
        """torch.export's dynamic_shapes for a module taking *flat."""
        return (self.spec(shapes),)


def batch_dims(carry: Spec, inputs: Spec, y: Spec, steps: int, kind: str,
               max_batch: int) -> BatchDims:
    carry_s, inputs_s = spec_leaves(carry), spec_leaves(inputs)
    stacked = [[steps] + s for s in spec_leaves(y)]
    ins, results = carry_s + inputs_s, carry_s + stacked
    if KINDS[kind]:
        ins, results = ins + results, results + ins
    dim = torch.export.Dim("B", min=1, max=max_batch)
    return BatchDims(dim, ins, results)


def capture(
    scan: Scan, args: list[torch.Tensor], outs: Tensors, kind: str, strict: bool,
    dyn: BatchDims | None = None,
) -> tuple[torch.nn.Module, Tensors]:
    """torch.export of the flat scan (or make_fx of its VJP, then export), as
    a graph that writes its results into buffers passed after its inputs.
    The forward is exported once, here, inside OutModule, as strictly as the
    job asks (an export of an unrolled RK4 loop takes seconds per 1 000
    steps' calls); a VJP's graph is an exported ATen graph already."""
    module, example = capture_values(scan, args, outs, kind, dyn)
    results = tuple(outs) + (tuple(args) if KINDS[kind] else ())
    bufs = tuple(torch.empty(r.shape, dtype=r.dtype) for r in results)
    shapes = dyn.of(dyn.inputs + dyn.results) if dyn else None
    try:
        ep = torch.export.export(OutModule(module, len(example)), example + bufs,
                                 strict=strict and not KINDS[kind], dynamic_shapes=shapes)
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return ep.module(), example + bufs


def capture_module(module: torch.nn.Module, example: Tensors,
                   results: list[torch.Tensor]) -> tuple[torch.nn.Module, Tensors]:
    """torch.export (non-strict) of a module over ATen graphs (saved.py's),
    in the daemon's calling convention."""
    bufs = tuple(torch.empty(r.shape, dtype=r.dtype) for r in results)
    try:
        ep = torch.export.export(OutModule(module, len(example)), example + bufs, strict=False)
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return ep.module(), example + bufs


def capture_values(
    scan: Scan, args: list[torch.Tensor], outs: Tensors, kind: str,
    dyn: BatchDims | None = None,
) -> tuple[torch.nn.Module, Tensors]:
    """The graph that returns its results: a VJP's exported (make_fx +
    export), the forward's module as it is (capture exports it).

    With a symbolic batch, make_fx traces the VJP symbolically (so no size is
    baked into its views and expands) and lets the body's module-level
    tensors in as real constants."""
    if kind == "vjp_checkpoint":
        if not dyn:
            return capture_checkpointed(scan, args, outs)
        # torch 2.14's Inductor cannot lower the scan op over a symbolic size
        scan.notes.append("dynamic = batch: the checkpointed VJP needs the scan op, which "
                          "torch's Inductor cannot lower over a symbolic batch; compiled "
                          "the plain VJP (intermediates kept, not recomputed) instead")
        log(scan.notes[-1])
        kind = "vjp"
    use_scan = scan.strategy != "unroll"  # the scan op's, or blocks of it
    if use_scan and dyn:
        # torch 2.14's Inductor fails on the scan op over a symbolic size
        # ("InductorError: KeyError: s39", forward and VJP alike): the unrolled
        # loop instead -- the same numbers, its compile time -- and the reply says so
        scan.notes.append(
            "dynamic = batch: torch's Inductor cannot lower the scan op over a symbolic "
            "batch; compiled the unrolled loop instead")
        log(scan.notes[-1])
        use_scan = False
    if kind != "vjp":
        scan.lowered = scan.strategy if use_scan else "unroll"
        return FlatModule(scan if use_scan else replace(scan, strategy="unroll")), tuple(args)
    try:
        ep, example = export_vjp(scan, args, outs, use_scan, dyn)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return ep.module(), example


def export_vjp(scan: Scan, args: list[torch.Tensor], outs: Tensors, use_scan: bool,
               dyn: BatchDims | None) -> tuple[torch.export.ExportedProgram, Tensors]:
    """make_fx of the VJP, then torch.export: the scan op's autograd formula
    when use_scan (the unrolled VJP if that cannot be captured), else
    torch.func.vjp of the unrolled loop."""
    from torch.fx.experimental.proxy_tensor import make_fx

    shapes = dyn.of(dyn.inputs) if dyn else None
    cot = cotangents(outs)
    example = tuple(args) + tuple(cot)
    if use_scan:
        lifted = [t.detach() for _, t in captured_tensors(scan.body)]
        try:
            # fake tensors throughout: with real ones, the scan op's
            # backward meets the lifted tensors real inside its fake trace
            gm = make_fx(vjp_module_autograd(scan, len(args), len(lifted)),
                         tracing_mode="symbolic" if dyn else "fake",
                         _allow_non_fake_inputs=dyn is not None)(*args, *cot, *lifted)
            ep = torch.export.export(Wrap(gm, lifted), example, strict=False,
                                     dynamic_shapes=shapes)
            scan.lowered = scan.strategy
            return ep, example
        except Exception as exc:  # noqa: BLE001 - the unrolled VJP below
            scan.notes.append(
                f"the scan op's VJP could not be captured ({type(exc).__name__}: "
                f"{str(exc)[:120]}); compiled the unrolled VJP instead")
            log(scan.notes[-1])
    gm = make_fx(vjp_module(replace(scan, strategy="unroll"), len(args)),
                 tracing_mode="symbolic" if dyn else "real",
                 _allow_non_fake_inputs=dyn is not None)(*args, *cot)
    scan.lowered = "unroll"
    return torch.export.export(Wrap(gm), example, strict=False, dynamic_shapes=shapes), example


def capture_checkpointed(scan: Scan, args: list[torch.Tensor],
                         outs: Tensors) -> tuple[torch.nn.Module, Tensors]:
    """The checkpointed VJP (checkpoint.py): each step's carry saved, the step
    recomputed in the reverse loop; whatever the adapter's strategy, both
    loops are the scan op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    nc = scan.n_carry
    step, captured = scan.flat_step(clone=False)
    lifted = [t.detach() for t in captured]
    cot = cotangents(outs)
    example = tuple(args) + tuple(cot)
    try:
        module = checkpoint.checkpointed_vjp(
            step, nc, len(args) - nc, len(lifted), [*args[:nc], *(a[0] for a in args[nc:]), *lifted])
        gm = make_fx(module, tracing_mode="fake")(*args, *cot, *lifted)
        ep = torch.export.export(Wrap(gm, lifted), example, strict=False)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    scan.lowered = "scan"
    scan.notes.append("checkpointed: the forward loop keeps each step's carry, the reverse "
                      "loop recomputes the step before its VJP")
    return ep.module(), example


def hold_lifted(module: torch.nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """Registers tensors as module's buffers (lifted0, lifted1, ...): torch.export
    traces them like parameters and AOTI keeps them as the graph's constants.
    Returns their names, in order."""
    names = [f"lifted{i}" for i in range(len(tensors))]
    for n, t in zip(names, tensors):
        module.register_buffer(n, t.detach(), persistent=True)
    return names


class FlatModule(torch.nn.Module):
    """The flat scan as a module for torch.export."""

    def __init__(self, scan: Scan) -> None:
        super().__init__()
        self.scan = scan
        # the scan op takes the body's captured tensors as inputs
        self.lifted = hold_lifted(self, [t for _, t in captured_tensors(scan.body)]
                                  if scan.strategy != "unroll" else [])

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lifted = [getattr(self, n) for n in self.lifted] if self.lifted else None
        return self.scan.forward(*flat, lifted=lifted)


class Wrap(torch.nn.Module):
    """A traced function (make_fx's graph) as a module for torch.export;
    lifted: tensors passed after the inputs, held as buffers (constants of
    the graph)."""

    def __init__(self, fn: Flat, lifted: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.lifted = hold_lifted(self, lifted or [])

    def forward(self, *flat: torch.Tensor) -> Tensors:
        return self.fn(*flat, *(getattr(self, n) for n in self.lifted))


class OutModule(torch.nn.Module):
    """The daemon's calling convention: inputs, then one buffer per result;
    the results are written into the buffers (the daemon passes the client's
    shared memory, or memory of its own) and the buffers are returned."""

    def __init__(self, fn: Flat, n_in: int) -> None:
        super().__init__()
        self.fn = fn
        self.n_in = n_in

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = self.fn(*flat[: self.n_in])
        bufs = flat[self.n_in :]
        for buf, r in zip(bufs, results):
            buf.copy_(r)
        return tuple(bufs)



"""The backward that does not run the forward again: job kinds "forward_save"
and "backward_saved" (docs/protocol.md, `scan` with `save`, `grad` with
`saved`).

The unrolled loop's joint graph (forward + VJP, make_fx of torch.func.vjp)
is split as AOTAutograd splits one: torch's min-cut partitioner decides
which of the forward's values the backward keeps and which it recomputes.

    forward_save    (*carry, *inputs) -> (*final carry, *stacked ys, saved)
    backward_saved  (*carry, *inputs, saved, *cotangents) -> (*grad carry, *grad inputs)

`saved` is one 1-D tensor of the request's dtype: every kept value that is
not a primal, flattened and laid end to end (a bool mask as 0/1); primals
the backward keeps come from the grad request's own carry and inputs, so
they are not sent twice.  Its length is the reply's "saved" (the daemon
checks the tensor a grad brings against it).  Both kinds trace and split
the same joint graph, so the layout agrees: the worker, the body, the
signature and torch are in both cache keys, and the daemon pairs the two
(`saved_key`).  A client's `saved` is data of the client's own gradient:
values only, never an index (a kept integer value refuses the compile), so
bytes it altered change that client's gradient and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from .errors import JobError, classify
from .lowering import Tensors, cotangents, vjp_module
from .parity import Case
from .scan import Scan
from .specs import Spec

KINDS = ("forward_save", "backward_saved")


@dataclass(frozen=True)
class Kept:
    """One value the backward keeps: primal `primal` (>= 0) of the request,
    or `numel` elements at `offset` of saved, viewed as shape and dtype."""

    primal: int
    offset: int = 0
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float64


@dataclass
class Split:
    fw: torch.fx.GraphModule  # (*primals) -> (*outs, *kept values)
    bw: torch.fx.GraphModule  # (*kept values, *tangents) -> (*grads)
    kept: list[Kept]
    length: int  # elements of saved
    n_out: int


def differentiated(wrt: str, n: int) -> list[int]:
    """The flat inputs whose gradients the graphs compute (the job's wrt)."""
    if wrt and (len(wrt) != n or set(wrt) - {"0", "1"}):
        raise JobError("COMPILE_FAILED", f"malformed job from the daemon: wrt {wrt!r} "
                       f"for {n} tensors")
    return [i for i in range(n) if not wrt or wrt[i] == "1"]


def joint_module(scan: Scan, n: int, wrt: str) -> Callable[..., Tensors]:
    """(primals, tangents) -> (*outs, *grads): torch.func.vjp of the unrolled
    loop with respect to the primals wrt marks; the others' gradients are
    zeros (so a weight that does not require grad costs no work)."""
    from torch.func import vjp

    unrolled = replace(scan, strategy="unroll")
    diff = differentiated(wrt, n)

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> Tensors:
        def fwd(*d: torch.Tensor) -> Tensors:
            full = list(primals)
            for i, t in zip(diff, d):
                full[i] = t
            return unrolled.forward(*full)

        grads = [torch.zeros_like(p) for p in primals]
        if not diff:
            return (*unrolled.forward(*primals), *grads)
        outs, pullback = vjp(fwd, *(primals[i] for i in diff))[:2]
        for i, g in zip(diff, pullback(tuple(tangents))):
            grads[i] = g
        return (*outs, *grads)

    return joint


def split(scan: Scan, args: list[torch.Tensor], outs: Tensors, wrt: str) -> Split:
    """The joint graph over fake tensors, partitioned by min cut."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx.experimental.proxy_tensor import make_fx

    n = len(args)
    joint = joint_module(scan, n, wrt)

    try:
        # make_fx names the inputs primals_i / tangents_i: what the partitioner reads
        gm = make_fx(joint, tracing_mode="fake", _allow_non_fake_inputs=True)(
            list(args), cotangents(outs))
        fw, bw = min_cut_rematerialization_partition(gm, None, num_fwd_outputs=len(outs))
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return Split(fw, bw, *plan(fw, bw, n, len(outs), getattr(torch, scan.dtype)), len(outs))


def graph_inputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """An FX graph's input nodes, in order (FX's op "placeholder")."""
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def plan(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, n_primals: int, n_out: int,
         dtype: torch.dtype) -> tuple[list[Kept], int]:
    """Where each kept value comes from; refuses what saved cannot carry."""
    inputs = graph_inputs(fw)
    out = next(iter(reversed(fw.graph.nodes)))
    values = list(out.args[0][n_out:])
    n_bw = len(graph_inputs(bw))
    if len(inputs) != n_primals or n_bw != len(values) + n_out:
        raise JobError("COMPILE_FAILED", f"the partitioned graphs take {len(inputs)} and "
                       f"{n_bw} inputs, not {n_primals} and {len(values)} + {n_out}")
    kept: list[Kept] = []
    offset = 0
    for v in values:
        if v in inputs:  # a primal the backward keeps: the grad request's own
            kept.append(Kept(inputs.index(v)))
            continue
        val = v.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in (dtype, torch.bool):
            what = getattr(val, "dtype", type(val).__name__)
            raise JobError("COMPILE_FAILED", f"the backward keeps a value of type {what} "
                           f"({v.name}): only {dtype} and bool values can be saved; use grad "
                           "without saved")
        shape = tuple(int(d) for d in val.shape)
        kept.append(Kept(-1, offset, shape, val.dtype))
        offset += math.prod(shape)
    return kept, offset


class SaveForward(torch.nn.Module):
    """(*primals) -> (*outs, saved)."""

    def __init__(self, s: Split, dtype: torch.dtype) -> None:
        super().__init__()
        self.fw, self.kept, self.n_out, self.dtype = s.fw, s.kept, s.n_out, dtype

    def forward(self, *primals: torch.Tensor) -> Tensors:
        res = self.fw(*primals)
        parts = [v.reshape(-1).to(self.dtype)
                 for k, v in zip(self.kept, res[self.n_out:]) if k.primal < 0]
        saved = torch.cat(parts) if parts else torch.zeros(0, dtype=self.dtype)
        return tuple(res[:self.n_out]) + (saved,)


class SavedBackward(torch.nn.Module):
    """(*primals, saved, *tangents) -> (*grads)."""

    def __init__(self, s: Split, n_primals: int) -> None:
        super().__init__()
        self.bw, self.kept, self.n = s.bw, s.kept, n_primals

    def forward(self, *flat: torch.Tensor) -> Tensors:
        primals, saved, tangents = flat[:self.n], flat[self.n], flat[self.n + 1:]
        values = []
        for k in self.kept:
            if k.primal >= 0:
                values.append(primals[k.primal])
                continue
            v = saved[k.offset:k.offset + math.prod(k.shape)].view(k.shape)
            values.append(v != 0 if k.dtype == torch.bool else v)
        return tuple(self.bw(*values, *tangents))


@dataclass
class Lowered:
    """What compile_job builds and checks for a saved kind."""

    module: torch.nn.Module  # takes example, returns results
    example: Tensors
    case: Case
    names: list[str]  # each result's name, for the parity check's messages
    y: Spec  # the reply's "y": (the outputs' spec, saved's) as a tuple


def lower(scan: Scan, args: list[torch.Tensor], outs: Tensors, kind: str, y_spec: Spec,
          wrt: str = "") -> Lowered:
    """The graph of kind, its example inputs and its parity case: the
    forward's results against the eager scan (saved against the split
    forward run eagerly), the backward's gradients against torch.func.vjp of
    the unrolled loop."""
    dtype = getattr(torch, scan.dtype)
    s = split(scan, args, outs, wrt)
    fwd = SaveForward(s, dtype)
    with torch.no_grad():
        saved = fwd(*args)[-1]
    nc = scan.n_carry
    y = {"k": "tuple", "c": [y_spec, {"k": "T", "s": [s.length]}]}
    if kind == "forward_save":
        names = ["carry"] * nc + ["outputs"] * (len(outs) - nc) + ["saved"]
        return Lowered(fwd, tuple(args), (0, tuple(args), [*outs, saved]), names, y)
    cot = cotangents(outs)
    dry = replace(scan, strategy="unroll", tracing=False)
    want = list(vjp_module(dry, len(args))(*args, *cot))[len(outs):]
    diff = differentiated(wrt, len(args))
    want = [w if i in diff else torch.zeros_like(w) for i, w in enumerate(want)]
    example = (*args, saved, *cot)
    names = ["grad_carry"] * nc + ["grad_inputs"] * (len(args) - nc)
    return Lowered(SavedBackward(s, len(args)), example, (0, example, want), names, y)

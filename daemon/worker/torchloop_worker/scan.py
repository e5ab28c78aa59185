"""One specialization's scan over flat tensors (Scan): the body stepped
T times (unrolled), as torch's scan op, or as the scan op over blocks of
unrolled steps (blocked.py); the body's module-level tensors lifted into the
scan op (captured_tensors, rebound)."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, cast

import torch

from .blocked import block_size, blocked
from .errors import JobError
from .graph_loader import GraphBody, GraphError
from .job import Body
from .specs import (Spec, Tree, carry_mismatch, flat_tensors, map_tensors, spec_build,
                    spec_leaves, tree_spec)

# the step over flat leaves: step(*carry leaves, *x leaves, *lifted) -> [*new carry, *y]
FlatStep = Callable[..., list[torch.Tensor]]


def row(leaf: torch.Tensor, t: int) -> torch.Tensor:
    return leaf[t]


@dataclass
class Scan:
    """One specialization's scan over flat tensors (the graph to compile)."""

    body: Body
    carry_spec: Spec
    inputs_spec: Spec
    steps: int
    dtype: str
    strategy: str
    y_spec: Spec = None
    tracing: bool = False  # False: the eager dry run, where failures are the body's
    # what the graph turned out to be, and why when it is not what the strategy
    # asked for (reported in the compile reply, describe and the log)
    lowered: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def n_carry(self) -> int:
        return len(spec_leaves(self.carry_spec))

    def step(self, carry: Tree, x: Tree, t: int) -> tuple[Tree, Tree]:
        try:
            out = self.body(carry, x)
        except JobError:
            raise
        except GraphError as exc:  # a request that does not fit the captured graph
            raise JobError(exc.code, exc.message, exc.path) from None
        except Exception as exc:
            if self.tracing:
                raise  # the body ran eagerly at this step: a capture problem
            raise JobError("BODY_ERROR", f"the body raised at step {t}: {exc!r}") from exc
        if not isinstance(out, tuple) or len(out) != 2:
            raise JobError(
                "BODY_ERROR",
                f"the body must return (new_carry, y); it returned {type(out).__name__} "
                f"at step {t}",
            )
        new_carry, y = out
        if self.tracing:
            # checked in the eager dry run; comparing a symbolic batch size with
            # the spec's here would pin it to the probe size
            return new_carry, y
        found = carry_mismatch(
            self.carry_spec, tree_spec(new_carry, "carry"), "carry", self.dtype
        )
        if found:
            path, what = found
            raise JobError(
                "CARRY_MISMATCH",
                f"{path}: {what} (the body must keep the carry's structure, shapes and "
                f"dtype; step {t})",
                path,
            )
        return new_carry, y

    def forward(self, *flat: torch.Tensor,
                lifted: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """lifted: the values of the body's captured tensors for the scan op
        (FlatModule's buffers under torch.export); None: the tensors themselves."""
        carry = spec_build(self.carry_spec, list(flat[: self.n_carry]), [0])
        xs = spec_build(self.inputs_spec, list(flat[self.n_carry :]), [0])
        if self.strategy == "unroll":
            return self.unrolled(carry, xs)
        k = block_size(self.strategy)
        if k:
            step, captured = self.flat_step(clone=False)
            return blocked(step, self.n_carry, self.steps, k, flat_tensors(carry),
                           flat_tensors(xs), captured if lifted is None else lifted)
        return self.hop(carry, xs, lifted)

    def unrolled(self, carry: Tree, xs: Tree) -> tuple[torch.Tensor, ...]:
        ys = []
        for t in range(self.steps):
            x_t = map_tensors(xs, partial(row, t=t))
            carry, y = self.step(carry, x_t, t)
            ys.append(y)
        self.y_spec = tree_spec(ys[0], "outputs")
        columns = [flat_tensors(y) for y in ys]
        stacked = [torch.stack([col[i] for col in columns]) for i in range(len(columns[0]))]
        return tuple(flat_tensors(carry)) + tuple(stacked)

    def hop(self, carry: Tree, xs: Tree,
            lifted: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """torch's scan higher-order op: Inductor lowers it to a while loop.

        Its combine function must be pure and see tensors only, so it takes
        and returns flat leaf lists and rebuilds the trees (None leaves
        included) inside; the structural checks ran in the eager dry run.
        Tensors the body captures from its module are lifted into the op's
        additional inputs: the combine function runs the body (and its
        module's helpers) over a copy of the module's globals in which those
        names are bound to the op's traced inputs, so the body's code is unchanged.
        """
        from torch._higher_order_ops.scan import scan_op

        combine, captured = self.flat_step(clone=True)
        if lifted is None:
            lifted = captured
        return tuple(scan_op(combine, flat_tensors(carry), flat_tensors(xs), tuple(lifted)))

    def flat_step(self, clone: bool) -> tuple[FlatStep, list[torch.Tensor]]:
        """(the step over flat leaves, the tensors the body captures from its
        module): step(*carry leaves, *x leaves, *lifted) -> [*new carry, *y].
        clone: every result a new tensor (the scan op refuses outputs that
        alias its inputs or each other, `return c, c`)."""
        carry_spec, inputs_spec, body = self.carry_spec, self.inputs_spec, self.body
        nc, nx = len(spec_leaves(carry_spec)), len(spec_leaves(inputs_spec))
        captured = captured_tensors(body)
        names = [n for n, _ in captured]

        def step(*flat: torch.Tensor) -> list[torch.Tensor]:
            c = spec_build(carry_spec, list(flat[:nc]), [0])
            x = spec_build(inputs_spec, list(flat[nc : nc + nx]), [0])
            fn = rebound(body, dict(zip(names, flat[nc + nx :]))) if names else body
            new_c, y = cast(tuple[Tree, Tree], fn(c, x))
            res = flat_tensors(new_c) + flat_tensors(y)
            return [t.clone() for t in res] if clone else res

        return step, [t for _, t in captured]


def rebound(fn: Body, values: dict[str, torch.Tensor]) -> Body:
    """fn over a copy of its module's globals where each name in values is
    that value instead; the module's other functions (the body's helpers)
    are rebound to the same copy, so they see the values too.  A captured
    graph takes its constants' values directly."""
    if isinstance(fn, GraphBody):
        return fn.with_tensors(values)
    assert isinstance(fn, types.FunctionType)  # only a function captures names
    g = dict(fn.__globals__)
    g.update(values)
    home = fn.__globals__

    def copy(f: types.FunctionType) -> types.FunctionType:
        new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
        new.__kwdefaults__ = f.__kwdefaults__
        new.__dict__.update(f.__dict__)
        return new

    for k, v in list(g.items()):
        if isinstance(v, types.FunctionType) and v.__globals__ is home and k not in values:
            g[k] = copy(v)
    return copy(fn)


def captured_tensors(fn: Body) -> list[tuple[str, torch.Tensor]]:
    """Module-level tensors the body's module refers to by name: the globals
    named in the code of any function defined in that module (the body's own
    helpers included), in a stable order.  A captured graph's are its constants."""
    if isinstance(fn, GraphBody):
        return fn.lifted_tensors()
    g = getattr(fn, "__globals__", {})
    mod = getattr(fn, "__module__", None)
    names: set[str] = set()

    def walk(code: types.CodeType) -> None:
        names.update(code.co_names)
        for k in code.co_consts:
            if hasattr(k, "co_names"):
                walk(k)

    for v in list(g.values()):
        code = getattr(v, "__code__", None)
        if code is not None and getattr(v, "__module__", None) == mod:
            walk(code)
    return [(n, g[n]) for n in sorted(names) if isinstance(g.get(n), torch.Tensor)]



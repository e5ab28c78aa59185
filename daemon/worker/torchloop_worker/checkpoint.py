"""The checkpointed VJP (job kind "vjp_checkpoint"): carries saved, steps recomputed.

The plain VJP graph (compile_worker.vjp_module) is the unrolled forward and
its reverse: it keeps every step's intermediates alive until the reverse
reaches that step, T x (everything the step computes).  A checkpointed one
keeps only the carry entering each step, T x carry, and recomputes the step
inside the reverse loop, one step's intermediates at a time:

    forward   scan op over t:        c_{t+1}, y_t = step(c_t, x_t); saves c_t
    reverse   scan op over T-1..0:   g_t, gx_t = vjp(step at c_t, x_t)(g_{t+1}, gy_t)

Both loops are torch's scan higher-order op, which Inductor lowers to a
while loop around one step's kernels: the recomputed step cannot be merged
with the forward's (a common-subexpression pass over an unrolled graph
would, and keep every intermediate alive again).  The step's VJP is traced
once with make_fx (torch.func.vjp), an ATen graph the reverse loop calls.

Carry leaves the step hands back unchanged (a captured graph's params, a
constant the body threads through) are saved once, not per step; their
gradients add up through the reverse loop like any carry's.  Tensors the body
captures from its module are the loops' additional inputs (as Scan.hop).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

Flat = Callable[..., Any]


def checkpointed_vjp(step: Flat, nc: int, nx: int, n_lifted: int,
                     example: list[Any]) -> Flat:
    """The flat VJP module over (*carry, *xs, *carry cots, *ys cots, *lifted),
    returning (*final carry, *stacked ys, *carry grads, *xs grads), as the
    plain VJP does.  example: one step's (*carry, *x row, *lifted)."""
    from torch._higher_order_ops.scan import scan_op

    fwd_fresh, joint_fresh, passed, kept, ny = _trace_step(step, nc, nx, n_lifted, example)

    def carry_of(var: Sequence[torch.Tensor],
                 const: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        by_leaf = dict(zip(kept, var)) | dict(zip(passed, const))
        return [by_leaf[k] for k in range(nc)]

    def module(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c0, xs = list(args[:nc]), list(args[nc: nc + nx])
        cot_c = list(args[nc + nx: nc + nx + nc])
        cot_ys = list(args[2 * nc + nx: 2 * nc + nx + ny])
        lifted = tuple(args[2 * nc + nx + ny:])
        const = tuple(c0[k] for k in passed)
        nk = len(kept)

        def forward_step(*f: torch.Tensor) -> list[torch.Tensor]:
            var, x = f[:nk], f[nk: nk + nx]
            cst, lift = f[nk + nx: nk + nx + len(passed)], f[nk + nx + len(passed):]
            res = fwd_fresh(*carry_of(var, cst), *x, *lift)
            # the new carry, y, and the carry this step started from (saved)
            return [res[k] for k in kept] + list(res[nc:]) + [v.clone() for v in var]

        res = scan_op(forward_step, [c0[k] for k in kept], xs, const + lifted)
        final = carry_of(res[:nk], const)
        ys, saved = res[nk: nk + ny], res[nk + ny:]
        stacked = [*saved, *xs, *cot_ys]

        def reverse_step(*f: torch.Tensor) -> list[torch.Tensor]:
            g, index = f[:nc], f[nc].reshape(1)
            rows = [t.index_select(0, index).squeeze(0) for t in f[nc + 1: nc + 1 + len(stacked)]]
            cst = f[nc + 1 + len(stacked): nc + 1 + len(stacked) + len(passed)]
            lift = f[nc + 1 + len(stacked) + len(passed):]
            return list(joint_fresh(*carry_of(rows[:nk], cst), *rows[nk: nk + nx], *lift,
                                    *g, *rows[nk + nx:]))

        # the reverse loop reads step T-1-t's rows where they lie (a reversed
        # copy of the saved carries would be T x carry more)
        order = torch.arange(xs[0].shape[0] - 1, -1, -1, dtype=torch.int64)
        back = scan_op(reverse_step, cot_c, [order], tuple(stacked) + const + lifted)
        grad_xs = [torch.flip(t, [0]) for t in back[nc:]]
        return tuple(final) + tuple(ys) + tuple(back[:nc]) + tuple(grad_xs)

    return module


class _Traced(NamedTuple):
    """One step, traced: its forward and its VJP (each fresh, see _fresh),
    the carry leaves it hands back as they came (passed: constants of both
    loops) and the others (kept), and how many ys it returns."""

    fwd: Flat
    joint: Flat
    passed: list[int]
    kept: list[int]
    ny: int


def _trace_step(step: Flat, nc: int, nx: int, n_lifted: int, example: list[Any]) -> _Traced:
    """step's forward and its VJP traced with make_fx (fake tensors), the
    VJP over (*carry, *x row, *lifted, *carry cots, *y cots) returning
    (*carry grads, *x grads)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import vjp

    fwd = make_fx(step, tracing_mode="fake")(*example)
    out = _outputs(fwd)
    phs = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    passed = [k for k in range(nc) if out[k] is phs[k]]
    kept = [k for k in range(nc) if k not in passed]

    def step_vjp(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, x = args[:nc], args[nc: nc + nx]
        lifted = args[nc + nx: nc + nx + n_lifted]
        cots = args[nc + nx + n_lifted:]
        pullback = vjp(lambda *p: tuple(fwd(*p, *lifted)), *c, *x)[1]
        return tuple(pullback(tuple(cots)))

    joint = make_fx(step_vjp, tracing_mode="fake")(*example, *[_like(o) for o in out])
    return _Traced(_fresh(fwd), _fresh(joint), passed, kept, len(out) - nc)


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    return list(next(n for n in gm.graph.nodes if n.op == "output").args[0])


def _fresh(gm: torch.fx.GraphModule) -> Flat:
    """gm, with a copy of each result that aliases an input or an earlier
    result (the scan op refuses those); the others are new tensors already."""
    out = _outputs(gm)
    aliased = []
    for i, node in enumerate(out):
        schema = getattr(node.target, "_schema", None)
        view = schema is not None and any(r.alias_info is not None for r in schema.returns)
        aliased.append(node.op == "placeholder" or view or node in out[:i])

    def run(*args: Any) -> list[Any]:
        res = gm(*args)
        return [t.clone() if a else t for t, a in zip(res, aliased)]

    return run


def _like(node: Any) -> Any:
    val = node.meta["val"]
    return torch.empty(val.shape, dtype=val.dtype)

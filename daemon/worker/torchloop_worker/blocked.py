"""Strategy "block<K>": torch's scan op over blocks of K unrolled steps.

The unrolled loop runs fastest (Inductor fuses across steps, no per-step
subgraph call) but its compile grows with T x the step's size: a 128-step
RK4 of a small system took 134 s here.  The scan op's graph (the quick tier)
compiles in seconds whatever T, but pays a while-loop iteration per step.
A blocked graph sits between them:

    scan op over q = T // K blocks:  c, ys[b] = K steps unrolled from c
    then r = T % K steps unrolled:   the tail

Its compile grows with K + r, not T, and it pays q loop iterations instead
of T.  The daemon picks K for a quick tier's upgrade from the step's size
and --upgrade-budget (daemon/graph/upgrade.c), then keeps whichever of the two
graphs runs faster -- which is not always the blocked one.  Each block's
steps are fused into one vectorized kernel, but each loop iteration still
allocates the step's results and a handle per carried tensor (about 5 us in
the daemon): lorenz's RK4 at T = 128 ran about 60 us as block25 and 107 us
as block9, against 20 us unrolled and 200 us for the scan op's graph
(torch 2.14, with wrapper_pass.py's changes; docs/architecture.md).

Tensors the body captures from its module are the scan op's additional
inputs (as Scan.hop); the tail reads the same values.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

Flat = Callable[..., list[torch.Tensor]]

_BLOCK = re.compile(r"block([1-9][0-9]{0,3})")


def block_size(strategy: str) -> int:
    """K of "block<K>", or 0 for any other strategy."""
    m = _BLOCK.fullmatch(strategy)
    return int(m.group(1)) if m else 0


def _steps(step: Flat, nc: int, carry: list[torch.Tensor], rows: Callable[[int], list[torch.Tensor]],
           lifted: list[torch.Tensor], count: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """count steps unrolled from carry; (final carry, each step's y leaves)."""
    columns = []
    for i in range(count):
        res = step(*carry, *rows(i), *lifted)
        carry = list(res[:nc])
        columns.append(list(res[nc:]))
    return carry, columns


def blocked(step: Flat, nc: int, steps: int, k: int, carry: list[torch.Tensor], xs: list[torch.Tensor],
            lifted: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(*final carry, *stacked ys) of steps steps of step (over flat leaves:
    step(*carry, *x row, *lifted) -> [*new carry, *y]), k at a time."""
    from torch._higher_order_ops.scan import scan_op

    q, r = divmod(steps, k)
    nx = len(xs)

    def stacked(columns: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.stack([col[j] for col in columns]) for j in range(len(columns[0]))]

    def combine(*flat: torch.Tensor) -> list[torch.Tensor]:
        block = flat[nc : nc + nx]
        c, columns = _steps(step, nc, list(flat[:nc]), lambda i: [b[i] for b in block],
                            list(flat[nc + nx :]), k)
        # the scan op refuses results that alias its inputs or each other
        return [t.clone() for t in c] + stacked(columns)

    heads = [x[: q * k].reshape(q, k, *x.shape[1:]) for x in xs]
    out = scan_op(combine, list(carry), heads, tuple(lifted))
    carry = list(out[:nc])
    ys = [y.reshape(q * k, *y.shape[2:]) for y in out[nc:]]
    if r:
        base = q * k
        carry, tail = _steps(step, nc, carry, lambda i: [x[base + i] for x in xs],
                             list(lifted), r)
        ys = [torch.cat([y, t]) for y, t in zip(ys, stacked(tail))]
    return tuple(carry) + tuple(ys)


def graph_ops(module: torch.nn.Module) -> int:
    """ATen calls in module's graphs, the scan op's subgraphs included."""
    return sum(1 for m in module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function")

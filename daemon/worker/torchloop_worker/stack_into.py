"""Stacked results straight into the daemon's buffers.

The graphs write their results into buffers they are given (OutModule).  The
unrolled loop's stacked outputs reach them as copy_(buffer, cat(parts)) --
torch.stack decomposes to a cat along dim 0 -- and Inductor lowers that as a
cat into a buffer of its own followed by a copy: one more pass over [T, ...]
(plain AOTI 204 µs against 310-343 µs for the out-variant at N = 4096,
T = 128, docs/performance.md).  StackIntoOutputs, a post-grad pass, swaps each
such copy for torchloop::cat_into_(buffer, parts), whose lowering is
Inductor's own cat (ConcatKernel.realize_into) over slices of the given
buffer: every part is computed straight into its rows, as a cat computes its
parts into its own buffer.  Parts that cannot be placed (an input, a view, a
part already placed elsewhere) are copied in, as a cat copies them.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, TypeGuard

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

CAT_INTO_OPS: list[Any] = []  # the op and its library, once defined in this process


def cat_into_op() -> torch._ops.OpOverload:
    """torchloop::cat_into_(Tensor(a!) dst, Tensor[] parts): dst's elements,
    in order, become the parts' elements, in order (row-major); with its
    Inductor lowering.  Defined once per process."""
    if CAT_INTO_OPS:
        return CAT_INTO_OPS[0]

    from torch._inductor import ir
    from torch._inductor.lowering import register_lowering
    from torch._inductor.virtualized import V

    lib = torch.library.Library("torchloop", "FRAGMENT")
    lib.define("cat_into_(Tensor(a!) dst, Tensor[] parts) -> ()")

    def eager(dst: torch.Tensor, parts: list[torch.Tensor]) -> None:
        dst.view(-1).copy_(torch.cat([p.reshape(-1) for p in parts]))

    lib.impl("cat_into_", eager, "CompositeExplicitAutograd")
    op = torch.ops.torchloop.cat_into_.default
    torch.library.register_fake("torchloop::cat_into_", lambda dst, parts: None, lib=lib)

    @register_lowering(op, type_promotion_kind=None)
    def lower(dst: ir.TensorBox, parts: list[ir.TensorBox]) -> None:
        dst.realize()
        storage, layout = ir.as_storage_and_layout(dst, freeze=True)
        offset = layout.offset
        # a NopKernel (as a cat is) that depends on every placed part and
        # marks dst mutated, so the parts are scheduled and kept
        kernel = ir.ConcatKernel(name=None, layout=ir.MutationLayoutSHOULDREMOVE(dst), inputs=[])
        placed: list[ir.IRNode] = []
        for part in parts:
            size = list(part.get_size())
            rows = ir.ReinterpretView(data=storage, layout=ir.FixedLayout(
                layout.device, layout.dtype, size, ir.FlexibleLayout.contiguous_strides(size),
                offset))
            placed.append(ir.ConcatKernel.realize_into(part, rows))
            offset = offset + math.prod(size)
        kernel.inputs = placed
        kernel.name = V.graph.register_buffer(kernel)
        kernel.inputs = ir.ConcatKernel.unwrap_storage(kernel.inputs)
        V.graph.register_operation(kernel)
        V.graph.mark_buffer_mutated(dst.get_name())

    CAT_INTO_OPS.extend([op, lib])  # the library object must outlive the op
    return op


def static_shape(val: object) -> TypeGuard[torch.Tensor]:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


class StackIntoOutputs(CustomGraphPass):
    """Post-grad pass: copy_(P, cat(parts, 0)) -- or copy_(P, view(cat)) --
    where P is a graph input (one of the daemon's result buffers), contiguous,
    of static shape and the cat's dtype and size, becomes cat_into_(P, parts).
    Counts what it rewrote (rewritten)."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __deepcopy__(self, memo: dict[int, object]) -> StackIntoOutputs:
        # Inductor's config deep-copies what it hands out: one counter
        return self

    def uuid(self) -> str:
        # Inductor's FX graph cache keys on it: this file's bytes
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def match(self, node: Node) -> tuple[Node, Node, Node, list[Node]] | None:
        """(dst, src, the cat, its parts) when node is such a copy_."""
        aten = torch.ops.aten
        dst, src = node.args[0], node.args[1]
        if not isinstance(dst, Node) or dst.op != "placeholder" or not isinstance(src, Node):
            return None
        cat = src
        if cat.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            inner = cat.args[0]
            if len(cat.users) != 1 or not isinstance(inner, Node):
                return None
            cat = inner
        if cat.target is not aten.cat.default or len(cat.users) != 1:
            return None
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        out, whole, parts = dst.meta.get("val"), cat.meta.get("val"), cat.args[0]
        if (dim != 0 or not static_shape(out) or not static_shape(whole)
                or not isinstance(parts, (list, tuple))
                or not all(isinstance(p, Node) for p in parts)
                or not out.is_contiguous() or out.dtype != whole.dtype
                or out.device.type != "cpu" or out.numel() != whole.numel()):
            return None
        nodes = [p for p in parts if isinstance(p, Node)]
        if not all(static_shape(v) and v.dtype == out.dtype
                   for v in (p.meta.get("val") for p in nodes)):
            return None
        return dst, src, cat, nodes

    def __call__(self, graph: Graph) -> None:
        for node in list(graph.nodes):
            if node.target is not torch.ops.aten.copy_.default:
                continue
            found = self.match(node)
            if found is None:
                continue
            dst, src, cat, parts = found
            with graph.inserting_before(node):
                graph.call_function(cat_into_op(), (dst, parts))
            node.replace_all_uses_with(dst)
            graph.erase_node(node)
            if not src.users:
                graph.erase_node(src)
            if cat is not src and not cat.users:
                graph.erase_node(cat)
            self.rewritten += 1



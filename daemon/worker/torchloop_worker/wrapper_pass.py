"""Less per-call work in the C++ wrapper AOTInductor generates (torch 2.14).

A graph's run is its kernels plus the wrapper's tensor handles, and for the
small states of a solver's step the handles cost more than the arithmetic.
Two things made them cost far more than they must:

- **Buffers of a subgraph that fusion removed were still allocated.**  The
  wrapper's memory planning drops the allocation of a buffer in
  `V.graph.removed_buffers`, but it runs once, for the whole wrapper, after
  the scan op's subgraphs (the while loop's cond and body) were generated
  with their own graphs: their removed buffers were not in the set it reads,
  so each loop iteration allocated (and freed) every intermediate buffer of
  the step, whether a kernel touched it or not -- 75 per iteration for 16
  RK4 steps of the Lorenz system.  `install` has each subgraph hand its
  removed buffers to its parent graph once generated (their names carry the
  subgraph's prefix, so nothing else is dropped).
  Lorenz RK4 at T = 32, the scan op over 2 blocks of 16 steps: 94 -> 30 us a
  call (the unrolled loop: 25).
- **A view per stacked row.**  A result that stacks each step's y is one
  buffer; each step's kernel argument is a view of it made with
  `reinterpret_tensor_wrapper` (a new tensor, then freed) at every call, used
  only for its data pointer: 128 of them for a 128-step unrolled loop.
  `alias_pointers` rewrites such a view, when its only uses are
  `(T*)(view.data_ptr())` and `view.reset()` and its base is neither reset
  nor moved before its last use, as `((T*)(base.data_ptr()) + offset)`:
  torch's `_reinterpret_tensor` adds its offset to the base's, in elements
  of the base's dtype, which a view of the same dtype shares.

- **The scan op's loop allocated and wrapped per iteration.**  Every
  iteration allocated each buffer its kernels write and made a new handle
  per carried tensor for each subgraph: loop_pass.py rewrites that loop,
  and loop_slots.py then puts its buffers in one arena and its tensors on
  pointers where the wrapper uses them only through their data.

All are installed once per process (`install`); the worker's cache key
covers this file, so artifacts built before it are rebuilt.  They are an
optimisation only: `STATE.changed` counts what they did in a build, and a
build they changed that fails (to build, or to match eager) is built again
with them off (`off()`, build.py's build_placed).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Callable, Iterator

from . import loop_pass, loop_slots
from .loop_pass import CAST, RESET, base_stable, index

ALIAS = re.compile(r"^\s*auto (\w+) = wrap_with_raii_handle_if_needed\("
                   r"reinterpret_tensor_wrapper\((\w+), \d+, \w+, \w+, (-?\d+)L?\)\);\s*// alias$")


class State:
    """Whether the pass is on, and what it changed since changed was last
    set to 0."""

    def __init__(self) -> None:
        self.on = True
        self.changed = 0


STATE = State()


@contextmanager
def off() -> Iterator[None]:
    """Builds inside the block get the wrapper as Inductor generates it."""
    STATE.on = False
    try:
        yield
    finally:
        STATE.on = True


def _uses(lines: list[str], where: dict[str, list[int]], start: int, name: str) -> list[int] | None:
    """Lines after start that name name, or None when one of them uses it
    other than through (T*)(name.data_ptr()) or name.reset()."""
    word = re.compile(rf"\b{name}\b")
    cast = re.compile(CAST.format(name=name))
    found = []
    for i in where.get(name, []):
        if i <= start:
            continue
        reset = RESET.match(lines[i])
        if not (reset and reset.group(1) == name) and word.search(cast.sub("", lines[i])):
            return None
        found.append(i)
    return found


def alias_pointers(code: str) -> tuple[str, int]:
    """code with each view used only for its data pointer replaced by
    pointer arithmetic on its base; (new code, views replaced)."""
    lines = code.split("\n")
    where = index(lines)
    drop: set[int] = set()
    replaced = 0
    for i, line in enumerate(lines):
        m = ALIAS.match(line)
        if not m:
            continue
        name, base, offset = m.group(1), m.group(2), int(m.group(3))
        uses = _uses(lines, where, i, name)
        if uses is None:
            continue
        reads = [u for u in uses if not RESET.match(lines[u])]
        if not base_stable(lines, i, reads[-1] if reads else i, base):
            continue
        cast = re.compile(CAST.format(name=name))
        plus = f" + {offset}" if offset else ""
        for u in uses:
            if RESET.match(lines[u]):
                drop.add(u)
            else:
                lines[u] = cast.sub(lambda c: f"(({c.group(1)})({base}.data_ptr()){plus})", lines[u])
        drop.add(i)
        replaced += 1
    return "\n".join(s for j, s in enumerate(lines) if j not in drop), replaced


def install(note: Callable[[str], None]) -> None:
    """The three changes, once per process, each applied while STATE.on;
    note(text) hears what the wrapper's rewrites did."""
    from torch._inductor import codecache
    from torch._inductor.graph import GraphLowering

    if getattr(GraphLowering.codegen_subgraph, "torchloop_pass", False):
        return
    orig_subgraph = GraphLowering.codegen_subgraph

    def codegen_subgraph(self: GraphLowering, parent_graph: GraphLowering) -> None:
        orig_subgraph(self, parent_graph=parent_graph)
        if STATE.on:
            STATE.changed += len(self.removed_buffers - parent_graph.removed_buffers)
            parent_graph.removed_buffers |= self.removed_buffers

    orig_compile = codecache.AotCodeCompiler.compile  # bound to the class

    def compile_aot(cls: type, graph: GraphLowering, wrapper_code: str, kernel_code: str,
                    serialized_extern_kernel_nodes: str | None, *, device_type: str,
                    additional_files: list[str]) -> object:
        if STATE.on:
            wrapper_code, n = alias_pointers(wrapper_code)
            STATE.changed += n
            if n:
                note(f"wrapper: {n} views replaced by pointer arithmetic")
            wrapper_code, n = loop_pass.alias_handles(wrapper_code)
            wrapper_code, hoisted, turns = loop_pass.loop_buffers(wrapper_code)
            wrapper_code, slotted, framed, refused = loop_slots.slot_wrapper(wrapper_code)
            STATE.changed += n + hoisted + turns + slotted + framed
            if n + hoisted + turns:
                note(f"wrapper: the scan op's loop: {n} tensor handles replaced by references, "
                     f"{hoisted} scratch buffers allocated once, {turns} handed-on buffers "
                     f"taken in turn from two; {slotted} loops on pointers into one arena"
                     + "".join(f"; a loop left on tensors: {why}" for why in refused))
            if framed:
                note(f"wrapper: {framed} of the run's buffers placed in one allocation")
        return orig_compile(graph, wrapper_code, kernel_code, serialized_extern_kernel_nodes,
                            device_type=device_type, additional_files=additional_files)

    codegen_subgraph.torchloop_pass = True  # type: ignore[attr-defined]
    GraphLowering.codegen_subgraph = codegen_subgraph  # type: ignore[method-assign]
    codecache.AotCodeCompiler.compile = classmethod(compile_aot)  # type: ignore[method-assign, assignment]

"""Capturing a body in the solver's process, as torch.compile does.

Each body's code gets its own `torch.compile(step, backend=..., fullgraph=True,
dynamic=False)` of `step(body, carry, x) = body(carry, x)`: dynamo traces ONE
step where the body lives (closures, `self`, callbacks, imports, Array-API
calls) and keeps the guards that decide when to trace again (a changed
Python float, shape, dtype, or a different object; not a new closure over
the same code and cells).  Its backend receives the FX graph of the step
with every tensor the body reads as an input, and returns a recorder: on
each call, dynamo's guards pass and the recorder receives the current
tensors, in the graph's input order, without running anything.

On a graph's first call the roles of its inputs are found by identity: a
carry leaf, an input row, or a tensor the body captures.  Captured tensors
of the scan's dtype are "live" (sent with every request, gradients reach
them); others (integer index tensors, another float dtype) are baked into
the graph as constants, and a change in their values makes a new graph.
The step is then exported to core ATen over (carry leaves, x leaves, live
tensors) and written as a `_graph` document, whose content names the
daemon adapter.  Capture costs one step's trace, whatever T.
"""

from __future__ import annotations

import builtins
import dis
import hashlib
import threading
import types
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Callable, Optional

import torch

from . import _graph, _polyfills
from ._graph import CaptureError, TreeDef
from ._wire import fast

MAX_VARIANTS = 16  # exported graphs kept per capture (one per set of baked values)
MAX_ROWS = 64  # row stand-ins kept per adapter (Capturer.rows)
RowKey = tuple[int, torch.Size, tuple[int, ...], torch.dtype]
Role = tuple[str, int]  # ("c"|"x"|"p"|"b", index): carry leaf, x leaf, live, baked


def _step(body: Callable[..., object], carry: object, x: object) -> object:
    # the marker makes a graph even for a body with no tensor op (dynamo calls
    # no backend for an empty graph); the export drops it
    return body(carry, x), torch.zeros(())


class _Recorded(threading.local):
    call: Optional[tuple["StepGraph", tuple[torch.Tensor, ...]]] = None


RECORDED = _Recorded()
_grad_enabled, _set_grad_enabled = torch._C.is_grad_enabled, torch._C._set_grad_enabled


def code_key(body: object) -> object:
    """What one compiled step is made for: the body's code (a closure rebuilt
    per run shares it; a bound method reads its function's), a partial's
    function's code."""
    code = getattr(body, "__code__", None)
    if code is not None:
        return code
    fn = getattr(body, "func", None) or body
    return getattr(fn, "__code__", None) or type(fn)


class StepGraph:
    """One dynamo capture: the step's FX graph, then its roles and exports."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        out = next(n for n in gm.graph.nodes if n.op == "output")
        n_out = len(out.args[0]) if isinstance(out.args[0], (tuple, list)) else 1
        # what dynamo hands back as the step's result; scan() never reads it
        self.fake = tuple(torch.empty(0) for _ in range(n_out))
        self.roles: list[Role] = []  # per graph input
        self.outs: list[Role] = []  # per result leaf: ("o", k) graph output k, or a Role
        self.out_def: TreeDef = None
        self.live: list[int] = []
        self.baked: list[int] = []
        self.bound = False
        self.plain: Optional[tuple[str, str]] = None  # the document, once bound with nothing baked
        self.docs: dict[bytes, tuple[str, str]] = {}  # baked values' digest -> (name, text)
        self.lock = threading.Lock()

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        RECORDED.call = (self, args)
        return self.fake

    def pick_live(self, args: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """This call's live captured tensors (the request's params)."""
        return [args[j] for j in self.live]

    def bind(self, args: tuple[torch.Tensor, ...], carry: list[torch.Tensor],
             xrow: list[torch.Tensor], result: object, dtype: torch.dtype) -> None:
        """The first call: every graph input's role and every result leaf's origin."""
        from .adapter import flatten  # the package's tree walk (paths in messages)

        ids: dict[int, Role] = {id(t): ("c", i) for i, t in enumerate(carry)}
        ids.update({id(t): ("x", i) for i, t in enumerate(xrow)})
        roles: list[Role] = []
        live: list[int] = []
        baked: list[int] = []
        for j, a in enumerate(args):
            role = ids.get(id(a))
            if role is None:
                pool = live if a.dtype == dtype and a.is_floating_point() else baked
                pool.append(j)
                role = ("p" if pool is live else "b", len(pool) - 1)
                ids[id(a)] = role
            roles.append(role)
        body_out = result[0] if isinstance(result, tuple) and len(result) == 2 else None
        if not isinstance(body_out, tuple) or len(body_out) != 2:
            raise TypeError("the body must return (new_carry, y); it returned "
                            f"{type(body_out).__name__}")
        leaves: list[torch.Tensor] = []
        out_def = ("tuple", [flatten(body_out[0], "carry", leaves),
                             flatten(body_out[1], "outputs", leaves)])
        ids.update({id(t): ("o", k) for k, t in enumerate(self.fake)})
        outs: list[Role] = []
        for leaf in leaves:
            if id(leaf) not in ids:
                raise CaptureError("the body returned a tensor that is neither computed by "
                                   "its graph nor one of its inputs")
            outs.append(ids[id(leaf)])
        self.roles, self.outs, self.out_def = roles, outs, out_def
        self.live, self.baked = live, baked
        self.bound = True

    def document(self, args: tuple[torch.Tensor, ...], flat: list[torch.Tensor], n_carry: int,
                 carry_def: TreeDef, x_def: TreeDef, definition: dict[str, Any]) -> tuple[str, str]:
        """(adapter name, graph text) for these baked values; exported once each.
        flat: this call's carry leaves and x rows (the export's examples)."""
        baked = [args[j] for j in self.baked]
        digest = b""
        if baked:  # their values are part of the graph: checked on every call
            h = hashlib.sha256()
            for t in baked:
                h.update(repr((t.dtype, tuple(t.shape))).encode())
                h.update(_graph.raw_bytes(t))
            digest = h.digest()
        doc = self.docs.get(digest)
        if doc is not None:
            return doc
        with self.lock:
            doc = self.docs.get(digest)
            if doc is None:
                module = _Flat(self, [t.detach().clone() for t in baked], n_carry,
                               len(flat) - n_carry)
                example = tuple(t.detach() for t in flat) + tuple(args[j].detach() for j in self.live)
                with torch.enable_grad():
                    ep = torch.export.export(module, example, strict=False).run_decompositions()
                text = _graph.write(ep, n_carry, len(flat) - n_carry, len(self.live),
                                    carry_def, x_def, self.out_def)
                if len(self.docs) >= MAX_VARIANTS:  # the oldest baked values go
                    self.docs.pop(next(iter(self.docs)))
                doc = self.docs[digest] = (_graph.identity(text, **definition), text)
                if not baked:
                    self.plain = doc
            return doc


class _Flat(torch.nn.Module):
    """The step over flat tensors: (carry leaves, x leaves, live) -> result leaves."""

    def __init__(self, g: StepGraph, baked: list[torch.Tensor], n_carry: int, n_x: int) -> None:
        super().__init__()
        self.g, self.n_carry, self.n_x = g, n_carry, n_x
        for k, t in enumerate(baked):
            self.register_buffer(f"baked_{k}", t)

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        base = {"c": 0, "x": self.n_carry, "p": self.n_carry + self.n_x}

        def value(role: Role) -> torch.Tensor:
            kind, i = role
            return getattr(self, f"baked_{i}") if kind == "b" else flat[base[kind] + i]

        res = self.g.gm(*[value(r) for r in self.g.roles])
        res = res if isinstance(res, (tuple, list)) else (res,)
        # an input handed back unchanged becomes a copy: results never alias inputs
        return tuple(res[i] if kind == "o" else value((kind, i)).clone()
                     for kind, i in self.g.outs)


# What dynamo's transformed bytecode of a step may do for the fast path to
# stand in for dynamo's call: read its arguments, call its profiling hooks
# and the graph, build the result.  Stores (replayed Python side effects of
# the body) and other calls send the call through dynamo's own wrapper.
_STORES = frozenset({"STORE_ATTR", "STORE_SUBSCR", "STORE_GLOBAL", "STORE_DEREF", "DELETE_ATTR",
                     "DELETE_SUBSCR", "DELETE_GLOBAL", "DELETE_DEREF", "STORE_NAME"})
_HOOKS = frozenset({"record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"})
_NO_HOOKS = types.SimpleNamespace(record_pregraph_bytecode_enter=lambda: None,
                                  record_pregraph_bytecode_exit=lambda *_: None)


def _graph_call_only(code: object) -> bool:
    calls, graphs = 0, 0
    for ins in dis.get_instructions(code):  # type: ignore[arg-type]
        if ins.opname in _STORES:
            return False
        if ins.opname == "LOAD_GLOBAL":
            name = str(ins.argval)
            graphs += name.startswith("__compiled_fn")
            if not name.startswith(("__compiled_fn", "__import_")):  # the graph, modules
                return False
        if ins.opname == "LOAD_ATTR" and str(ins.argval).startswith("record_") and \
                str(ins.argval) not in _HOOKS:
            return False
        calls += ins.opname.startswith("CALL")  # CALL_KW, CALL_FUNCTION_EX... count too
    return graphs == 1 and calls <= 1 + len(_HOOKS)


class _Fast:
    """Dynamo's guards and transformed bytecode for one compiled step, run
    without dynamo's Python wrapper (about 15 µs a call): the same guard
    managers, checked in dynamo's order, and the same code, so the same
    graph is picked and handed the same tensors.  Entries whose bytecode does
    more than call the graph are left out; an empty list means dynamo's call.
    Capturer.capture runs the entries."""

    def __init__(self, step: Callable[..., object]) -> None:
        self.inner = getattr(step, "_torchdynamo_orig_callable", None)
        self.entries: list[tuple[Callable[[dict[str, object]], bool], Callable[..., object]]] = []

    def refresh(self) -> None:
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = _debug_get_cache_entry_list(self.inner.__code__)  # type: ignore[union-attr]
            self.entries = [(e.guard_manager.check, run) for e in entries
                            if (run := self._runner(e.code)) is not None]
        except (AttributeError, TypeError, ImportError):  # another torch's internals
            self.entries = []

    def _runner(self, code: types.CodeType) -> Callable[..., object] | None:
        """The transformed step over globals of its own: the recorder itself
        instead of dynamo's disable() wrapper around it, no profiling hooks."""
        if code.co_freevars or not _graph_call_only(code):
            return None
        scope: dict[str, object] = {"__builtins__": builtins}
        for ins in dis.get_instructions(code):
            name = str(ins.argval)
            if ins.opname != "LOAD_GLOBAL":
                continue
            value = self.inner.__globals__.get(name)  # type: ignore[union-attr]
            if name.startswith("__compiled_fn"):
                scope[name] = getattr(value, "__wrapped__", None)
                if not isinstance(scope[name], StepGraph):
                    return None
            elif name == "__import_torch_dot__dynamo_dot_utils":
                scope[name] = _NO_HOOKS
            elif isinstance(value, types.ModuleType):  # a module the body reads from
                scope[name] = value
            else:
                return None
        return FunctionType(code, scope)


@dataclass
class Capturer:
    """One adapter's captures: a compiled step per body code object."""

    steps: dict[object, tuple[Callable[..., object], _Fast]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    captures: int = 0  # dynamo traces (a guard failed, or a new body code)
    fast_calls: int = 0  # calls the fast path served
    # (leaf position, shape, strides, dtype) -> its row's stand-in
    row_of: dict[RowKey, torch.Tensor] = field(default_factory=dict)
    last_rows: list[list[torch.Tensor]] = field(default_factory=lambda: [[]])  # _fast.rows's

    def _backend(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> StepGraph:
        self.captures += 1
        return StepGraph(gm)

    def compiled(self, body: object) -> tuple[Callable[..., object], _Fast]:
        key = code_key(body)
        entry = self.steps.get(key)
        if entry is None:
            with self.lock:
                entry = self.steps.get(key)
                if entry is None:
                    _polyfills.register()  # array_namespace's guards, once
                    # a code object of its own: dynamo's recompile limit (8
                    # variants) counts per body code, not per adapter
                    unique = FunctionType(_step.__code__.replace(), _step.__globals__)
                    fn = torch.compile(unique, backend=self._backend, fullgraph=True,
                                       dynamic=False)
                    entry = self.steps[key] = (fn, _Fast(fn))
        return entry

    def rows(self, xs: list[torch.Tensor], max_steps: int) -> list[torch.Tensor] | None:
        """What the step is traced at and its guards are checked against, per
        input leaf: a zero tensor with row 0's shape, strides and dtype, kept
        per (leaf position, shape, strides, dtype) (dynamo reads only those:
        a row made per call cost about 2 µs a leaf of a warm scan, and a kept
        view would keep the caller's storage alive).  A subclass, a leaf off
        the CPU or without strides gets its real row.  None when
        T is out of bounds or the leaves disagree (adapter.check_rows says
        which).  _fast.rows does the warm case in C, with the same keys."""
        if fast is not None:
            rows = fast.rows(xs, max_steps, self.row_of, self.last_rows)
            if rows is not None:
                return rows
        if not xs or not xs[0].shape:
            return None
        steps = xs[0].shape[0]
        if not 1 <= steps <= max_steps:
            return None
        rows = []
        for i, t in enumerate(xs):
            shape = t.shape
            if not shape or shape[0] != steps:
                return None
            if type(t) is not torch.Tensor or not t.is_cpu or t.layout != torch.strided:
                rows.append(t.detach()[0])
                continue
            key = (i, shape, t.stride(), t.dtype)
            row = self.row_of.get(key)
            if row is None:
                if len(self.row_of) >= MAX_ROWS:
                    self.row_of.pop(next(iter(self.row_of)))
                row = self.row_of[key] = torch.empty_strided(
                    shape[1:], key[2][1:], dtype=t.dtype).zero_()
            rows.append(row)
        return rows

    def capture(self, body: object, carry: object, xrow: object) -> tuple[StepGraph, tuple[torch.Tensor, ...], object]:
        """Runs the guards (tracing when they fail); the graph and this call's tensors."""
        fn, fast_step = self.steps.get(code_key(body)) or self.compiled(body)
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)  # the capture's grad mode (a guard)
        try:
            frame = {"body": body, "carry": carry, "x": xrow}
            for check, run in fast_step.entries:  # _Fast: dynamo's guards, in its order
                if check(frame):
                    result = run(body, carry, xrow)
                    self.fast_calls += 1
                    break
            else:
                RECORDED.call = None
                captures = self.captures
                result = fn(body, carry, xrow)
                if self.captures != captures:  # dynamo has a new entry
                    fast_step.refresh()
        finally:
            if grad:
                _set_grad_enabled(True)
        rec = RECORDED.call
        if rec is None:
            raise RuntimeError(
                "torch.compile ran the body without a graph (its recompile limit, "
                f"torch._dynamo.config.recompile_limit = {torch._dynamo.config.recompile_limit}, "
                "was reached for this body, or compilation is disabled); torchloop needs the "
                "captured graph"
            )
        RECORDED.call = None
        return rec[0], rec[1], result

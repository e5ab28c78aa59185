"""Capturing a body in the solver's process, as torch.compile does.

Each body's code gets its own `torch.compile(step, backend=..., fullgraph=True,
dynamic=False)` of `step(body, carry, x) = body(carry, x)` (of a code object
of its own: a shard; more below): dynamo traces ONE
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

Dynamo keeps at most torch._dynamo.config.recompile_limit (8) variants per
code object, and a ninth raises with fullgraph.  A solver that builds one
closure per method, RHS or configuration has many variants of one body
code, so a body code has shards (_Shard): copies of the step's code, each
taking no more captures than dynamo's limit allows.  A call goes to the shard with
an entry whose guards accept it (checked as the fast path does, without
dynamo's wrapper), a capture to the most recently used shard with room or
to a new shard; past Capturer.max_shards the least recently used shard is
dropped, and its variants are captured again if they return.
"""

from __future__ import annotations

import builtins
import dis
import hashlib
import threading
import types
import weakref
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Callable, Optional

import torch

from . import _graph, _polyfills
from ._graph import CaptureError, Doc, TreeDef
from ._wire import fast

MAX_VARIANTS = 16  # exported graphs kept per capture (one per set of baked values)
MAX_SHARDS = 8  # code copies kept per body code (Capturer.max_shards): 64 variants
MAX_ROWS = 64  # row stand-ins kept per adapter (Capturer.rows)
RowKey = tuple[int, torch.Size, tuple[int, ...], torch.dtype]
Role = tuple[str, int]  # ("c"|"x"|"p"|"b", index): carry leaf, x leaf, live, baked


def _step(body: Callable[..., object], carry: object, x: object) -> object:
    # the marker makes a graph even for a body with no tensor op (dynamo calls
    # no backend for an empty graph); the export drops it
    return body(carry, x), torch.zeros(())


class _Recorded(threading.local):
    call: Optional[tuple["StepGraph", tuple[torch.Tensor, ...]]] = None
    shard: Optional["_Shard"] = None  # the shard whose code dynamo is running


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
        self.plain: Optional[Doc] = None  # the document, once bound with nothing baked
        self.docs: dict[bytes, Doc] = {}  # baked values' digest -> its document
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
                 carry_def: TreeDef, x_def: TreeDef, definition: dict[str, Any]) -> Doc:
        """The document (adapter name, graph text, checks) for these baked values; exported once each.
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
                text, checks = _graph.write(ep, n_carry, len(flat) - n_carry, len(self.live),
                                            carry_def, x_def, self.out_def)
                if len(self.docs) >= MAX_VARIANTS:  # the oldest baked values go
                    self.docs.pop(next(iter(self.docs)))
                doc = self.docs[digest] = Doc(_graph.identity(text, **definition), text, checks)
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
    managers, checked in dynamo's order, so the same entry is picked and its
    code handed the same tensors.  An entry whose bytecode does more than
    call the graph has no runner (None): its calls go through dynamo's own
    wrapper, which picks it again.  ok is False when this torch's internals
    could not be read: every call is then dynamo's.  Capturer.capture runs
    the entries."""

    def __init__(self, step: Callable[..., object]) -> None:
        self.inner = getattr(step, "_torchdynamo_orig_callable", None)
        self.entries: list[tuple[Callable[[dict[str, object]], bool],
                                 Optional[Callable[..., object]]]] = []
        self.ok = self.inner is not None

    def refresh(self) -> None:
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            entries = _debug_get_cache_entry_list(self.inner.__code__)  # type: ignore[union-attr]
            # in place: _Shard.entries is this list
            self.entries[:] = [(e.guard_manager.check, self._runner(e.code)) for e in entries]
        except (AttributeError, TypeError, ImportError):  # another torch's internals
            self.entries.clear()
            self.ok = False

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


class _Shard:
    """A code object of the step's own, and dynamo's variants of it: dynamo
    keeps its compiled entries, and counts them against its recompile limit
    (torch._dynamo.config.recompile_limit, 8), per code object; a shard takes
    at most that many captures, so dynamo never refuses one.

    Dynamo's entries live on the code (its co_extra, which the garbage
    collector does not see) and refer back to it (dynamo's orig_code_map,
    transformed code -> original code; utils.guard_failures, keyed by the
    code): a dropped code copy would never be freed.  So when the shard
    object goes (dropped, and no call still using it) _release empties the
    code's cache as torch._dynamo.eval_frame.remove_from_cache does; the
    entries' transformed code then goes, and with it the globals dynamo
    installed for them (the graphs' `__compiled_fn_*`, by dynamo's cleanup
    hooks) and so the StepGraphs.  Nothing dynamo keeps refers to the shard
    (the backend is the Capturer's).  (Measured: every dropped code is freed
    but the process's first one, which torch's internals hold on to: one
    code object, its entries emptied, not one per drop.)"""

    __slots__ = ("fn", "fast", "entries", "captures", "__weakref__")

    def __init__(self, backend: Callable[..., object]) -> None:
        code = _step.__code__.replace()
        self.fn = torch.compile(FunctionType(code, _step.__globals__), backend=backend,
                                fullgraph=True, dynamic=False)
        self.fast = _Fast(self.fn)
        self.entries = self.fast.entries  # the warm call's (one attribute less)
        self.captures = 0  # dynamo's traces of this code (its backend's calls)
        weakref.finalize(self, _release, code).atexit = False

    def has_room(self) -> bool:
        """Whether dynamo takes one more capture of this code; without a way
        to route calls between shards (fast.ok False) there is one shard,
        and dynamo's limit is the capture's."""
        return not self.fast.ok or self.captures < torch._dynamo.config.recompile_limit


def _release(code: types.CodeType) -> None:
    """Frees dynamo's entries for a dropped shard's code (_Shard)."""
    try:
        from torch._dynamo.eval_frame import reset_code
        from torch._dynamo.utils import guard_failures
    except ImportError:  # another torch's internals: the code stays
        return
    reset_code(code)
    guard_failures.pop(code, None)


@dataclass
class Capturer:
    """One adapter's captures: per body code object, its shards (most
    recently used first), each a compiled step with at most dynamo's
    recompile limit of variants; past max_shards the least recently used
    shard goes, and its variants are captured again if they return."""

    steps: dict[object, tuple[_Shard, ...]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    max_shards: int = MAX_SHARDS
    captures: int = 0  # dynamo traces (a guard failed, or a new body code)
    fast_calls: int = 0  # calls the fast path served
    dropped: int = 0  # shards dropped past max_shards
    # (leaf position, shape, strides, dtype) -> its row's stand-in
    row_of: dict[RowKey, torch.Tensor] = field(default_factory=dict)
    last_rows: list[list[torch.Tensor]] = field(default_factory=lambda: [[]])  # _fast.rows's

    def _backend(self, gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> StepGraph:
        self.captures += 1
        shard = RECORDED.shard  # dynamo traces in the calling thread
        if shard is not None:
            shard.captures += 1
        return StepGraph(gm)

    def compiled(self, body: object) -> tuple[_Shard, ...]:
        """body's shards, the first one made on its code's first call."""
        key = code_key(body)
        shards = self.steps.get(key)
        if shards is None:
            with self.lock:
                shards = self.steps.get(key)
                if shards is None:
                    _polyfills.register()  # array_namespace's guards, once
                    shards = self.steps[key] = (_Shard(self._backend),)
        return shards

    def _with_room(self, key: object) -> _Shard:
        """The most recently used shard with room for a capture, else a new
        one in front (the least recently used dropped past max_shards)."""
        with self.lock:
            shards = self.steps[key]
            for shard in shards:
                if shard.has_room():
                    return shard
            shard = _Shard(self._backend)
            kept = (shard,) + shards
            self.dropped += max(0, len(kept) - self.max_shards)
            self.steps[key] = kept[:max(1, self.max_shards)]
            return shard

    def _to_front(self, key: object, shard: _Shard) -> None:
        with self.lock:
            shards = self.steps.get(key, ())
            if shard in shards and shards[0] is not shard:
                self.steps[key] = (shard,) + tuple(s for s in shards if s is not shard)

    def _dynamo_call(self, key: object, shard: Optional[_Shard], body: object, carry: object,
                     xrow: object) -> object:
        """Dynamo's call of shard (whose entry accepted the call), or a
        capture into the shard with room."""
        if shard is None:
            shard = self._with_room(key)
        RECORDED.call, RECORDED.shard = None, shard
        captures = shard.captures
        try:
            result = shard.fn(body, carry, xrow)
        finally:
            RECORDED.shard = None
        if shard.captures != captures:  # dynamo has a new entry
            shard.fast.refresh()
        if self.steps[key][0] is not shard:
            self._to_front(key, shard)
        return result

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
        key = code_key(body)
        shards = self.steps.get(key) or self.compiled(body)
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)  # the capture's grad mode (a guard)
        try:
            frame = {"body": body, "carry": carry, "x": xrow}
            # _Fast: dynamo's guards, in its order, the most recently used
            # shard first; run None: dynamo's call runs the entry
            shard: Optional[_Shard]
            run: Optional[Callable[..., object]]
            for shard in shards:
                for check, run in shard.entries:
                    if check(frame):
                        break
                else:
                    continue
                break
            else:
                shard = run = None
            if run is not None:
                result = run(body, carry, xrow)
                self.fast_calls += 1
                if shard is not shards[0]:
                    self._to_front(key, shard)  # type: ignore[arg-type]
            else:
                result = self._dynamo_call(key, shard, body, carry, xrow)
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

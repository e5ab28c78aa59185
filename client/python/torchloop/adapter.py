"""loop_adapter: the reference LoopAdapter contract, served by torchloopd.

    adapter = torchloop.loop_adapter(max_steps=128, max_elements=65536)
    register_loop_adapter("array_api_compat.torch", adapter)
    final, ys = adapter.scan(body, carry, inputs)

`scan` captures one step of the body in this process (capture.py: any
callable torch.compile(fullgraph=True, dynamic=False) accepts; dynamo's
guards decide when to capture again), registers the graph with the daemon
under a name derived from its content and the bounds, and runs the scan
there.  With capture=False it registers a module-level body's source
instead (admins only).  Carry, inputs and results are trees of tuples,
lists, dicts (string keys) and tensors or None; structure round-trips
exactly.  When a leaf (or a tensor the body captures) requires grad, the
results are connected to the autograd graph: backward runs the daemon's
grad op (first order; a double backward raises).  The forward of such a
scan keeps what the backward needs (the daemon's `scan` with `save`: the
unrolled loop's joint graph split by torch's min-cut partitioner) and the
backward uses it instead of running the forward again (`grad` with
`saved`); the kept tensor lives in the connection's shared region and dies
with the autograd graph.  `adapter.checkpoint(body)` marks a body whose
backward keeps only each step's carry and recomputes the step (the
daemon's checkpointed VJP graph).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable, NoReturn

import torch

# the tree walks are this module's names too (capture.py, _local.py, tests)
from ._call import Target, _Call, _ScanFunction, _frozen, flatten, leaf_paths, unflatten
from ._eagerfirst import EagerFirst, copied, eager_scan
from ._graph import Doc
from ._local import LocalRuns
from .capture import Capturer
from .client import Client
from .errors import TorchloopError, TorchloopValueError

# Codes a scan with save, or its grad with saved, may get where the plain
# scan and grad would not (the saved pair cannot be built for this body, or
# the adapter changed in between): the scan's calls go the plain way after.
SAVE_FALLBACK = frozenset({
    "INVALID_ARGUMENT", "COMPILE_FAILED", "COMPILE_TIMEOUT", "MISCOMPILE", "UNSUPPORTED_OP",
    "PROXY_EXECUTOR_REQUIRED", "RECOMPILE_BUDGET_EXHAUSTED", "SAVED_MISMATCH",
    "FRAME_TOO_LARGE"})  # saved inline (not in the region) over the daemon's --max-frame

NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class LoopAdapter:
    """Stand-in of op_engine.loop_ops.LoopAdapter when op_engine is not installed."""

    scan: Callable[..., tuple[Any, Any]]
    checkpoint: Callable[..., Any] | None = None


def _adapter_class() -> type:
    try:
        return import_module("op_engine.loop_ops").LoopAdapter
    except ImportError:
        return LoopAdapter


# ---- bounds (the reference adapter's checks and messages) -------------------
# proto/protocol.h's PROTO_MAX_* / PROTO_DEFAULT_*; tests/python/test_limits.py
# checks that they agree.

MAX_STEPS, DEFAULT_STEPS = 128, 128
MAX_ELEMENTS, DEFAULT_ELEMENTS = 1_048_576, 65_536
DEFAULT_BUDGET = 8  # PROTO_DEFAULT_BUDGET


def check_bounds(max_steps: object, max_elements: object) -> None:
    if type(max_steps) is not int or not 1 <= max_steps <= MAX_STEPS:
        raise ValueError(f"max_steps must be an integer in [1, {MAX_STEPS}]")
    if type(max_elements) is not int or not 1 <= max_elements <= MAX_ELEMENTS:
        raise ValueError(f"max_elements must be an integer in [1, {MAX_ELEMENTS}]")
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 14):
        raise ValueError("Compiled loops require Torch >=2.14; eager Torch is unchanged")


def body_source(body: Callable[..., Any]) -> tuple[str, str]:
    """(module source, function name) of a module-level function."""
    if not callable(body) or not hasattr(body, "__qualname__"):
        raise TypeError("body must be a function body(carry, x) -> (new_carry, y)")
    if body.__qualname__ != body.__name__:
        raise TypeError(
            f"body {body.__qualname__} must be a module-level function: torchloopd imports "
            "its module's source, so closures, lambdas and methods cannot be registered"
        )
    module = inspect.getmodule(body)
    if module is None:
        raise TypeError(f"cannot find the module of body {body.__name__}")
    try:
        return inspect.getsource(module), body.__name__
    except (OSError, TypeError) as exc:
        raise TypeError(f"cannot read the source of {module.__name__}: {exc}") from exc


class _Driver:
    """What a loop_adapter's scan closes over: bounds, a client, registrations.

    capture=True (the default): every body is captured in this process
    (capture.py) and its graph registered under its content's name; the
    live captured tensors go as the request's params (the graph's carry is
    (carry, params), passed through unchanged and not sent back), so
    gradients reach those tensors (grad_params).  capture=False: a
    module-level body's module source is registered (admins only)."""

    def __init__(self, max_steps: int, max_elements: int, socket: str | None,
                 name: str | None, dynamic: str | None = None, capture: bool = True,
                 eager_first: bool = False, save: bool = True, run: str = "daemon") -> None:
        self.max_steps, self.max_elements = max_steps, max_elements
        self.run = run
        # run="local": captured graphs' forward scans run here (_local.py)
        self.local = LocalRuns() if run == "local" and capture else None
        # a graph's backward from what its forward kept (dynamic = batch: never)
        self.save = save and dynamic != "batch"
        self.unsaved: set[str] = set()  # adapters whose saved pair failed (SAVE_FALLBACK)
        # _eagerfirst.py: captured graphs' scans run in process while they compile
        self.eager = EagerFirst(socket) if eager_first else None
        self.dynamic = dynamic
        self.socket = socket
        self.client = Client(socket)
        self.name = name
        self.capture = capture
        self.capturer = Capturer()
        # every field of a graph adapter's definition, sent explicitly: its
        # name hashes them (_graph.identity), as the daemon checks
        self.graph_def: dict[str, Any] = dict(
            max_steps=max_steps, max_elements=max_elements, recompile_budget=DEFAULT_BUDGET,
            strategy="unroll", dynamic=dynamic or "none")
        self.registered: dict[tuple[str, str], str] = {}
        self.graphs: set[str] = set()  # captured graphs this driver registered
        # body function -> adapter name: reading a module's source per scan
        # (inspect.getsource) cost about 10 µs of a 30 µs small scan
        self.by_body: dict[Callable[..., Any], str] = {}
        self.lock = threading.Lock()
        self.last_x: tuple[list[torch.Tensor], Any, Any] | None = None  # _row_tree's

    def __reduce__(self) -> tuple[Any, ...]:
        """A driver pickles as its settings: the unpickled one connects anew."""
        return (_Driver, (self.max_steps, self.max_elements, self.socket, self.name,
                          self.dynamic, self.capture, self.eager is not None, self.save,
                          self.run))

    def adapter_for(self, body: Callable[..., Any]) -> str:
        try:  # a body seen before: its module's source is not read again
            name = self.by_body.get(body)
        except TypeError:  # an unhashable callable: body_source says what is wrong
            name = None
        if name is not None:
            return name
        source, entry = body_source(body)
        with self.lock:
            key = (source, entry)
            if key not in self.registered:
                self.registered[key] = self._register(source, entry, getattr(body, "__module__", ""))
            self.by_body[body] = self.registered[key]
            return self.registered[key]

    def _register(self, source: str, entry: str, module: str) -> str:
        digest = hashlib.sha256(
            f"{source}\0{entry}\0{self.max_steps}\0{self.max_elements}"
            f"{'' if self.dynamic is None else chr(0) + self.dynamic}".encode()
        ).hexdigest()[:16]
        name = self.name or f"py.{entry[:40]}.{digest}"
        if len(name) > 64 or not set(name) <= NAME_CHARS:
            raise ValueError("adapter name must match [A-Za-z0-9._-]{1,64}")
        self.client.register(name, source, entry, body_file=f"{module}.py",
                             max_steps=self.max_steps, max_elements=self.max_elements,
                             dynamic=self.dynamic)
        return name

    def _register_graph(self, name: str, text: str) -> None:
        self.client.register_graph(name, text, **self.graph_def)
        with self.lock:
            self.graphs.add(name)

    def send(self, op: str, target: Target, **fields: Any) -> dict:
        """One op; registers again if the daemon forgot the adapter (a restart,
        or a captured graph evicted by the per-user cap)."""
        if isinstance(target, Doc):
            name = target.name
            if name not in self.graphs:
                self._register_graph(name, target.text)
        else:
            name = self.adapter_for(target)
        try:
            return self.client.call(op, adapter=name, **fields)
        except TorchloopError as exc:
            if exc.code != "NOT_FOUND":
                raise
            if isinstance(target, Doc):
                self._register_graph(target.name, target.text)
                return self.client.call(op, adapter=name, **fields)
            with self.lock:
                self.registered = {k: v for k, v in self.registered.items() if v != name}
                self.by_body = {k: v for k, v in self.by_body.items() if v != name}
            return self.client.call(op, adapter=self.adapter_for(target), **fields)

    def name_of(self, target: Target) -> str:
        """The adapter name a target runs under."""
        return target.name if isinstance(target, Doc) else self.adapter_for(target)

    def saving(self, target: Target) -> bool:
        """Whether a scan of target with gradients keeps saved for its backward."""
        return self.save and self.name_of(target) not in self.unsaved

    def unsave(self, target: Target, why: TorchloopError) -> None:
        """target's scans go the plain way from now on (why: SAVE_FALLBACK's)."""
        if why.code not in SAVE_FALLBACK:
            raise why
        name = self.name_of(target)
        with self.lock:
            self.unsaved.add(name)

    def prepare(self, body: Callable[..., Any], carry: Any, carry_def: Any, inputs_def: Any,
                leaves: list[torch.Tensor], n_carry: int) -> tuple[Target, list[torch.Tensor]]:
        """(what to run, live captured tensors) for this call's body and trees."""
        if not self.capture:
            return body, []
        if not callable(body):
            raise TypeError("body must be a callable body(carry, x) -> (new_carry, y)")
        rows = self.capturer.rows(leaves[n_carry:], self.max_steps)
        if rows is None:
            check_rows(inputs_def, leaves[n_carry:], self.max_steps)
        cs = leaves[:n_carry]
        for t in cs:
            if t.requires_grad:  # the body sees the carry's values only
                cs = [t.detach() for t in cs]
                carry = unflatten(carry_def, cs, [0])
                break
        g, args, result = self.capturer.capture(body, carry, self._row_tree(rows, inputs_def))
        if g.plain is not None:  # bound, and nothing baked: the one document
            return g.plain, g.pick_live(args)
        if not g.bound:
            g.bind(args, cs, rows, result, leaves[0].dtype)
        target = g.document(args, cs + rows, n_carry, carry_def, inputs_def, self.graph_def)
        return target, g.pick_live(args)

    def _row_tree(self, rows: list[torch.Tensor], inputs_def: Any) -> Any:
        """The x the step is captured at: rows in the inputs' structure; the
        last call's tree again when its rows and structure are the same and
        it has no list or dict (which a body could change)."""
        last = self.last_x
        if last is not None and last[0] is rows and last[1] == inputs_def:
            return last[2]
        tree = unflatten(inputs_def, rows, [0])
        if _frozen(inputs_def):
            self.last_x = (rows, inputs_def, tree)
        return tree

    def scan(self, body: Callable[..., Any], carry: Any, inputs: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            raise RuntimeError("a torchloop scan cannot run inside torch.compile: it is "
                               "compiled already, by the daemon")
        checkpointed = isinstance(body, Checkpointed)
        while isinstance(body, Checkpointed):
            body = body.body
        leaves: list[torch.Tensor] = []
        carry_def = flatten(carry, "carry", leaves)
        n_carry = len(leaves)
        inputs_def = flatten(inputs, "inputs", leaves)
        target, params = self.prepare(body, carry, carry_def, inputs_def, leaves, n_carry)
        call = _Call(self, target, carry_def, inputs_def, n_carry, len(params), checkpointed)
        every = leaves + params
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in every)
        call.save = grad and not checkpointed and self.saving(target)
        if self.eager is not None and isinstance(target, Doc) and \
                self._compiling(target, every, grad, checkpointed, carry, inputs, params,
                                call.wrt([t.requires_grad for t in every]) if call.save else None):
            return eager_scan(body, carry, inputs_def, leaves[n_carry:])
        if self.local is not None and not grad and isinstance(target, Doc):
            done = self.local.scan(self, target, carry, inputs, leaves, n_carry, params,
                                   carry_def)
            if done is not None:
                return done
        if grad:
            flat = _ScanFunction.apply(call, *every)
            pos = [0]
            return unflatten(call.final_def, list(flat), pos), unflatten(call.outputs_def, list(flat), pos)
        res = call.send("scan", carry, inputs, params)  # the user's own trees: checked by flatten
        return res["carry"], res["outputs"]


    def _compiling(self, target: Doc, every: list[torch.Tensor], grad: bool,
                   checkpointed: bool, carry: Any, inputs: Any, params: list[torch.Tensor],
                   save: dict[str, str] | None) -> bool:
        """eager_first: whether the daemon is compiling this scan's graph
        (_eagerfirst.py; the graph is registered first)."""
        assert self.eager is not None
        name = target.name
        if name not in self.graphs:
            self._register_graph(name, target.text)
        key = EagerFirst.key(name, every, grad, checkpointed)
        return self.eager.runs_eagerly(
            key, lambda: dict(adapter=name, carry=copied(carry), inputs=copied(inputs),
                              params=tuple(copied(p) for p in params)), grad, checkpointed,
            save)


def check_rows(inputs_def: Any, xs: list[torch.Tensor], max_steps: int) -> NoReturn:
    """The daemon's checks that capture needs first (it traces row 0): raises
    the error of the first input leaf that fails them."""
    if not xs:
        raise TorchloopValueError(
            "NO_INPUTS", "inputs has no tensor leaf: the scan length T comes from the inputs",
            "inputs")
    paths = leaf_paths(inputs_def, "inputs")
    for path, t in zip(paths, xs):
        if t.ndim == 0:
            raise TorchloopValueError(
                "BAD_RANK", f"{path} is 0-d; input leaves need a leading scan axis (ndim >= 1)",
                path)
        if t.shape[0] != xs[0].shape[0]:
            raise TorchloopValueError(
                "LENGTH_MISMATCH", f"{path} has leading length {t.shape[0]} but {paths[0]} has "
                f"{xs[0].shape[0]}: input leaves share one T", path)
        if not 1 <= t.shape[0] <= max_steps:
            raise TorchloopValueError(
                "TOO_MANY_STEPS", f"{path}: T={t.shape[0]} is outside [1, max_steps={max_steps}]",
                path)
    raise AssertionError("check_rows found no error that Capturer.rows found")


class Checkpointed:
    """`adapter.checkpoint(body)`: the same step (called directly it is the
    body), for which a scan's backward keeps only the carry entering each
    step and recomputes the step in the reverse loop, instead of keeping
    every step's intermediates (the daemon's `grad` with `checkpoint`: a
    graph of its own; the forward graph is the plain body's)."""

    __slots__ = ("body",)

    def __init__(self, body: Callable[..., Any]) -> None:
        if not callable(body):
            raise TypeError("checkpoint needs a callable body(carry, x) -> (new_carry, y)")
        self.body = body

    def __call__(self, carry: Any, x: Any) -> Any:
        return self.body(carry, x)

    def __repr__(self) -> str:
        return f"checkpoint({self.body!r})"


def checkpoint(body: Callable[..., Any]) -> Checkpointed:
    """The LoopAdapter's checkpoint transform (see Checkpointed)."""
    return Checkpointed(body)


def loop_adapter(*, max_steps: int = DEFAULT_STEPS, max_elements: int = DEFAULT_ELEMENTS,
                 socket: str | None = None, name: str | None = None,
                 dynamic: str | None = None, capture: bool | None = None,
                 eager_first: bool = False, save: bool = True, run: str | None = None) -> Any:
    """A LoopAdapter whose scan runs in torchloopd (see the module docstring).

    dynamic="batch" compiles one graph per (structure, T, dtype) that serves
    every batch size: dimension 0 of each carry leaf and dimension 1 of each
    input leaf (docs/protocol.md, "Symbolic batch").

    eager_first=True (captured bodies): while the daemon compiles a scan's
    graph, that scan and the same scans after it run the body eagerly in
    this process; the scan after the compile goes to the daemon
    (_eagerfirst.py).

    save=True (the default): a scan with gradients runs the forward graph
    that keeps what the backward needs, and its backward the graph that
    uses it (two compiles, no forward run again); save=False: the backward
    runs the VJP graph, which computes the forward again (one compile).

    run="local" (default: $TORCHLOOP_RUN, else "daemon"): a captured body's
    scans without gradients run the daemon's compiled graph in this process
    (the daemon compiles and caches it; _local.py, docs/python.md "Local
    runs"); "daemon": every scan runs in the daemon.

    Raises ValueError with the reference adapter's messages for bad bounds or
    a torch older than 2.14, for a dynamic other than None, "none" or
    "batch", and for a run other than "local" or "daemon".  Nothing connects
    until the first scan.
    """
    check_bounds(max_steps, max_elements)
    if dynamic not in (None, "none", "batch"):
        raise ValueError('dynamic must be "none" or "batch"')
    if capture is None:
        capture = dynamic != "batch"
    elif capture and dynamic == "batch":
        raise ValueError('dynamic="batch" needs capture=False: a captured graph has the '
                         "static shapes it was captured at")
    if eager_first and not capture:
        raise ValueError("eager_first=True needs capture: a source body is not traced here")
    run = run if run is not None else os.environ.get("TORCHLOOP_RUN", "daemon")
    if run not in ("local", "daemon"):
        raise ValueError('run must be "local" or "daemon"')
    driver = _Driver(max_steps, max_elements, socket, name, dynamic, capture, bool(eager_first),
                     bool(save), run)
    return _adapter_class()(scan=driver.scan, checkpoint=checkpoint)

"""loop_adapter: the reference LoopAdapter contract, served by torchloopd.

    adapter = torchloop.loop_adapter(max_steps=128, max_elements=65536)
    register_loop_adapter("array_api_compat.torch", adapter)
    final, ys = adapter.scan(body, carry, inputs)

`scan` registers the body's module source and function name with the
daemon once (under a name derived from their content and the bounds, or the
`name` given), then runs the scan there.  Carry, inputs and results are
trees of tuples, lists, dicts (string keys) and tensors or None; structure
round-trips exactly.  When a leaf requires grad, the results are connected
to the autograd graph: backward runs the daemon's grad op (first order; a
double backward raises).
"""

from __future__ import annotations

import hashlib
import inspect
import threading
from dataclasses import dataclass
from importlib import import_module
from typing import Any, Callable

import torch
from torch.autograd.function import once_differentiable

from .client import Client
from .errors import TorchloopError

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


# ---- trees ------------------------------------------------------------------

def flatten(tree: Any, path: str, leaves: list[torch.Tensor]) -> Any:
    """Appends tree's tensor leaves to leaves; returns its structure (a "def")."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return "T"
    if isinstance(tree, tuple):
        return ("tuple", [flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(tree)])
    if isinstance(tree, list):
        return ("list", [flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(tree)])
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str):
                raise TypeError(f"{path}: dict keys must be strings, got {type(key).__name__}")
        return ("dict", list(tree), [flatten(v, f'{path}["{k}"]', leaves) for k, v in tree.items()])
    raise TypeError(f"{path}: leaves must be tensors or None, got {type(tree).__name__}")


def unflatten(tdef: Any, leaves: list[Any], pos: list[int]) -> Any:
    if tdef is None:
        return None
    if tdef == "T":
        leaf = leaves[pos[0]]
        pos[0] += 1
        return leaf
    if tdef[0] == "dict":
        return {k: unflatten(c, leaves, pos) for k, c in zip(tdef[1], tdef[2])}
    children = [unflatten(c, leaves, pos) for c in tdef[1]]
    return tuple(children) if tdef[0] == "tuple" else children


# ---- bounds (the reference adapter's checks and messages) -------------------
# proto/protocol.h's PROTO_MAX_* / PROTO_DEFAULT_*; tests/python/test_limits.py
# checks that they agree.

MAX_STEPS, DEFAULT_STEPS = 128, 128
MAX_ELEMENTS, DEFAULT_ELEMENTS = 1_048_576, 65_536


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
    """What a loop_adapter's scan closes over: bounds, a client, registrations."""

    def __init__(self, max_steps: int, max_elements: int, socket: str | None,
                 name: str | None, dynamic: str | None = None) -> None:
        self.max_steps, self.max_elements = max_steps, max_elements
        self.dynamic = dynamic
        self.client = Client(socket)
        self.name = name
        self.registered: dict[tuple[str, str], str] = {}
        # body function -> adapter name: reading a module's source per scan
        # (inspect.getsource) cost about 10 µs of a 30 µs small scan
        self.by_body: dict[Callable[..., Any], str] = {}
        self.lock = threading.Lock()

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

    def call(self, op: str, body: Callable[..., Any], **fields: Any) -> dict:
        """One op for body; registers again if the daemon forgot it (a restart)."""
        name = self.adapter_for(body)
        try:
            return self.client.call(op, adapter=name, **fields)
        except TorchloopError as exc:
            if exc.code != "NOT_FOUND":
                raise
            with self.lock:
                self.registered = {k: v for k, v in self.registered.items() if v != name}
                self.by_body = {k: v for k, v in self.by_body.items() if v != name}
            return self.client.call(op, adapter=self.adapter_for(body), **fields)

    def scan(self, body: Callable[..., Any], carry: Any, inputs: Any) -> tuple[Any, Any]:
        if torch.compiler.is_compiling():
            raise RuntimeError("a torchloop scan cannot run inside torch.compile: it is "
                               "compiled already, by the daemon")
        leaves: list[torch.Tensor] = []
        carry_def = flatten(carry, "carry", leaves)
        n_carry = len(leaves)
        inputs_def = flatten(inputs, "inputs", leaves)
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            call = _Call(self, body, carry_def, inputs_def, n_carry)
            flat = _ScanFunction.apply(call, *leaves)
            pos = [0]
            return unflatten(call.final_def, list(flat), pos), unflatten(call.outputs_def, list(flat), pos)
        res = self.call("scan", body, carry=carry, inputs=inputs)
        return res["carry"], res["outputs"]


class _Call:
    """One differentiable scan: the trees' structure, filled in by forward."""

    def __init__(self, driver: _Driver, body: Callable[..., Any], carry_def: Any,
                 inputs_def: Any, n_carry: int) -> None:
        self.driver, self.body = driver, body
        self.carry_def, self.inputs_def, self.n_carry = carry_def, inputs_def, n_carry
        self.final_def: Any = None
        self.outputs_def: Any = None
        self.n_final = 0

    def trees(self, leaves: tuple[torch.Tensor, ...]) -> tuple[Any, Any]:
        flat = [t.detach() for t in leaves]
        return (unflatten(self.carry_def, flat, [0]),
                unflatten(self.inputs_def, flat[self.n_carry:], [0]))


class _ScanFunction(torch.autograd.Function):
    """Connects a daemon scan to autograd; backward is the daemon's grad op."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        carry, inputs = call.trees(leaves)
        res = call.driver.call("scan", call.body, carry=carry, inputs=inputs)
        out: list[torch.Tensor] = []
        call.final_def = flatten(res["carry"], "carry", out)
        call.n_final = len(out)
        call.outputs_def = flatten(res["outputs"], "outputs", out)
        ctx.call = call
        ctx.save_for_backward(*leaves)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # autograd runs backward in grad mode only for create_graph=True, i.e.
        # when a second derivative is wanted: the daemon has none to give
        if torch.is_grad_enabled():
            raise RuntimeError(
                "torchloop scans are differentiable to first order only: the daemon "
                "computes one vector-Jacobian product (create_graph=True / double backward)"
            )
        return _ScanFunction._vjp(ctx, grads)

    @staticmethod
    @once_differentiable
    def _vjp(ctx: Any, grads: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        call: _Call = ctx.call
        carry, inputs = call.trees(ctx.saved_tensors)
        cots = [g.contiguous() if g is not None else None for g in grads]
        cot_carry = unflatten(call.final_def, cots, [0])
        cot_outputs = unflatten(call.outputs_def, cots[call.n_final:], [0])
        res = call.driver.call("grad", call.body, carry=carry, inputs=inputs,
                               cot_carry=cot_carry, cot_outputs=cot_outputs)
        gleaves: list[torch.Tensor] = []
        flatten(res["grad_carry"], "grad_carry", gleaves)
        flatten(res["grad_inputs"], "grad_inputs", gleaves)
        return (None, *gleaves)


def loop_adapter(*, max_steps: int = DEFAULT_STEPS, max_elements: int = DEFAULT_ELEMENTS,
                 socket: str | None = None,
                 name: str | None = None, dynamic: str | None = None) -> Any:
    """A LoopAdapter whose scan runs in torchloopd (see the module docstring).

    dynamic="batch" compiles one graph per (structure, T, dtype) that serves
    every batch size: dimension 0 of each carry leaf and dimension 1 of each
    input leaf (docs/protocol.md, "Symbolic batch").

    Raises ValueError with the reference adapter's messages for bad bounds or
    a torch older than 2.14, and for a dynamic other than None, "none" or
    "batch".  Nothing connects until the first scan.
    """
    check_bounds(max_steps, max_elements)
    if dynamic not in (None, "none", "batch"):
        raise ValueError('dynamic must be "none" or "batch"')
    driver = _Driver(max_steps, max_elements, socket, name, dynamic)
    return _adapter_class()(scan=driver.scan)

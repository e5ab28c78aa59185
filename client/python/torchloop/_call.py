"""One scan call's pieces, under adapter.py's driver: the trees' walks
(flatten, unflatten, leaf_paths, _frozen), what a scan runs (Target), the
per-call object _Call (a scan's target, trees' structure and ops) and the
autograd Function _ScanFunction (backward: the daemon's grad op, or the
saved pair's local run).

This module imports nothing from adapter.py (the driver reaches _Call
through the ScanDriver protocol below); adapter.py re-exports the tree
walks, so `from torchloop.adapter import flatten` keeps working.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, Union

import torch
from torch.autograd.function import once_differentiable

from ._checks import run_checks
from ._graph import Doc
from .errors import TorchloopError

if TYPE_CHECKING:
    from ._local import LocalRuns
    from .client import Client


Target = Union[Callable[..., Any], Doc]  # a body (source) or a captured graph's document


# ---- trees ------------------------------------------------------------------

class _NotATree(Exception):
    pass


def _flatten(tree: Any, leaves: list[torch.Tensor]) -> Any:
    """flatten without paths (every scan walks its trees: no string per node)."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return "T"
    if isinstance(tree, tuple):
        return ("tuple", [_flatten(v, leaves) for v in tree])
    if isinstance(tree, list):
        return ("list", [_flatten(v, leaves) for v in tree])
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str):
                raise _NotATree
        return ("dict", list(tree), [_flatten(v, leaves) for v in tree.values()])
    raise _NotATree


def flatten(tree: Any, path: str, leaves: list[torch.Tensor]) -> Any:
    """Appends tree's tensor leaves to leaves; returns its structure (a "def").
    Raises TypeError naming the first leaf that is not a tensor or None."""
    try:
        return _flatten(tree, leaves)
    except _NotATree:
        _raise_at_bad_leaf(tree, path)
        raise


def _raise_at_bad_leaf(tree: Any, path: str) -> None:
    """The TypeError for the first node of tree that is not a tree's."""
    if tree is None or isinstance(tree, torch.Tensor):
        return
    if isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            _raise_at_bad_leaf(v, f"{path}[{i}]")
        return
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str):
                raise TypeError(f"{path}: dict keys must be strings, got {type(key).__name__}")
        for k, v in tree.items():
            _raise_at_bad_leaf(v, f'{path}["{k}"]')
        return
    raise TypeError(f"{path}: leaves must be tensors or None, got {type(tree).__name__}")


def unflatten(tdef: Any, leaves: Sequence[torch.Tensor], pos: list[int]) -> Any:
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


def leaf_paths(tdef: Any, path: str) -> list[str]:
    if tdef is None:
        return []
    if tdef == "T":
        return [path]
    if tdef[0] == "dict":
        return [p for k, c in zip(tdef[1], tdef[2]) for p in leaf_paths(c, f'{path}["{k}"]')]
    return [p for i, c in enumerate(tdef[1]) for p in leaf_paths(c, f"{path}[{i}]")]


def _frozen(tdef: Any) -> bool:
    """Whether a tree of this structure has only tuples (no list or dict)."""
    return tdef is None or tdef == "T" or (tdef[0] == "tuple" and all(map(_frozen, tdef[1])))


# ---- a scan ------------------------------------------------------------------

class ScanDriver(Protocol):
    """What a _Call uses of its driver (adapter._Driver)."""

    client: Client  # LocalRuns' _Sender

    @property
    def local(self) -> Optional[LocalRuns]: ...  # run="local": the saved pair's runs here

    def send(self, op: str, target: Target, **fields: Any) -> dict: ...

    def unsave(self, target: Target, why: TorchloopError) -> None: ...


class _Call:
    """One scan: what it runs, the trees' structure (results' filled in by run)."""

    def __init__(self, driver: ScanDriver, target: Target, carry_def: Any, inputs_def: Any,
                 n_carry: int, n_params: int, checkpoint: bool = False) -> None:
        self.driver, self.target = driver, target
        self.carry_def, self.inputs_def, self.n_carry = carry_def, inputs_def, n_carry
        self.n_params = n_params
        self.checkpoint = checkpoint  # its grad asks for the checkpointed VJP graph
        self.save = False  # its scan keeps saved for its grad (_ScanFunction)
        self.wrapped = isinstance(target, Doc)  # a captured graph: live tensors are params
        self.checks = target.checks if isinstance(target, Doc) else ()  # its info outputs
        self.final_def: Any = None
        self.outputs_def: Any = None
        self.n_final = 0

    def wrt(self, needs: Sequence[bool]) -> dict[str, str]:
        """The saved pair's `wrt` field: which leaves' gradients to compute
        (needs: per leaf, in this call's order), in the daemon's order (carry,
        params, inputs); none when all of them."""
        n_in = len(needs) - self.n_params
        order = [*needs[:self.n_carry], *needs[n_in:], *needs[self.n_carry:n_in]]
        mask = "".join("1" if n else "0" for n in order)
        return {} if "0" not in mask else {"wrt": mask}

    def local_save(self, leaves: tuple[torch.Tensor, ...], wrt: dict[str, str]) -> dict | None:
        """A scan with save run in this process (run="local"), or None."""
        local = self.driver.local
        if local is None or not isinstance(self.target, Doc):
            return None
        return local.scan_save(self.driver, self, leaves, wrt)

    def local_grad(self, leaves: tuple[torch.Tensor, ...], cots: Sequence[torch.Tensor | None],
                   saved: torch.Tensor, wrt: dict[str, str]) -> list[torch.Tensor] | None:
        """The backward of a local scan with save (its saved is a tensor of
        this process), run here, or None."""
        local = self.driver.local
        if local is None or not isinstance(self.target, Doc) or not saved.is_cpu:
            return None
        return local.grad_saved(self.driver, self, leaves, cots, saved, wrt)

    def run(self, op: str, leaves: tuple[torch.Tensor, ...], **cots: Any) -> dict:
        """The op over flat leaves (carry, inputs, then the captured tensors)."""
        n_in = len(leaves) - self.n_params
        return self.send(op, unflatten(self.carry_def, leaves, [0]),
                         unflatten(self.inputs_def, leaves[self.n_carry:n_in], [0]),
                         leaves[n_in:], **cots)

    def send(self, op: str, carry: Any, inputs: Any, params: Sequence[torch.Tensor],
             **cots: Any) -> dict:
        """The op over the request's trees: carry, inputs and (a captured
        graph's live tensors, which the daemon passes to every step and does
        not send back) params.  The codec sends a tensor's values (detached)."""
        try:
            if not self.wrapped:
                return self.driver.send(op, self.target, carry=carry, inputs=inputs, **cots)
            res = self.driver.send(op, self.target, carry=carry, inputs=inputs,
                                   params=tuple(params), **cots)
        except TorchloopError as exc:
            if not self.wrapped:
                raise
            raise _said_of_the_body(exc) from None
        if self.checks and "outputs" in res:  # the body's y, its checks' infos
            res["outputs"] = run_checks(res["outputs"], self.checks)
        return res


def _said_of_the_body(exc: TorchloopError) -> TorchloopError:
    """A daemon error about params[k]: the user passed no params, the body
    captured tensor k."""
    def fix(text: str) -> str:
        return re.sub(r"params\[(\d+)\]", r"the body's captured tensor #\1", text)

    return type(exc)(exc.code, fix(exc.message), fix(exc.path))


class _ScanFunction(torch.autograd.Function):
    """Connects a daemon scan to autograd; backward is the daemon's grad op."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.kept = None  # (saved, saved_key, wrt) of a scan with save, for the grad
        res = None
        if call.save:
            wrt = call.wrt(ctx.needs_input_grad[1:])
            try:
                res = call.local_save(leaves, wrt) or call.run("scan", leaves, save=True, **wrt)
                ctx.kept = (res["saved"], res["saved_key"], wrt)
            except TorchloopError as exc:
                call.driver.unsave(call.target, exc)
        if res is None:
            res = call.run("scan", leaves)
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
        cots = [g.contiguous() if g is not None else None for g in grads]
        cot_carry = unflatten(call.final_def, cots, [0])
        cot_outputs = unflatten(call.outputs_def, cots[call.n_final:], [0])
        if call.checks:  # the checks' info outputs have none
            cot_outputs = (cot_outputs, (None,) * len(call.checks))
        leaves = tuple(ctx.saved_tensors)
        res = None
        if ctx.kept is not None:
            saved, key, wrt = ctx.kept
            ctx.kept = None  # freed with this call, not with the graph
            try:
                local = call.local_grad(leaves, cots, saved, wrt)
                if local is not None:
                    return (None, *local)
                res = call.run("grad", leaves, cot_carry=cot_carry, cot_outputs=cot_outputs,
                               saved=saved, saved_key=key, **wrt)
            except TorchloopError as exc:
                call.driver.unsave(call.target, exc)
        if res is None:
            more = {"checkpoint": True} if call.checkpoint else {}
            res = call.run("grad", leaves, cot_carry=cot_carry, cot_outputs=cot_outputs, **more)
        gleaves: list[torch.Tensor] = []
        flatten(res["grad_carry"], "grad_carry", gleaves)
        flatten(res["grad_inputs"], "grad_inputs", gleaves)
        flatten(res.get("grad_params", ()), "grad_params", gleaves)  # the captured tensors last
        return (None, *gleaves)

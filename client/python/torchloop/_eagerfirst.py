"""eager_first: while the daemon compiles a graph, its scans run in process.

With `loop_adapter(eager_first=True)`, the first scan of a specialization
(a captured body's graph at one dtype and one set of shapes; with gradients
wanted, its VJP graph too) is sent from a thread of its own, on a connection
of its own.  The daemon checks the request as it always does:

- it answers without compiling (the graph is in memory or in a cache): the
  scan goes to the daemon, as without eager_first;
- it refuses the request (a bound, a shape): the scan goes to the daemon,
  which gives the same error;
- it starts a compile (its `compiling` notification): the scan runs the body
  eagerly in this process, step by step (the reference's eager loop;
  autograd records it), and so does every scan of that specialization
  until the compile is done.  The scan after that goes to the daemon; if
  the compile failed, it gets the daemon's error.

So a solver's first call costs the capture and an eager loop, not a
compile, and its results match the compiled graph's to rounding (float64
≤ 1e-10 relative); the price is that the compile shares the CPU with the
eager calls, and a compile error is raised one call late.  Off by default.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from .client import Client
from .errors import TorchloopError

Key = tuple[Any, ...]


class _Background:
    """One specialization's first request, sent and waited for on a thread."""

    def __init__(self, socket: str | None) -> None:
        self.client = Client(socket)
        self.client.on_event = self._event
        self.answered = threading.Event()  # a compile started, or the reply came
        self.compiling = False
        self.done = False
        self.error: Optional[TorchloopError] = None

    def _event(self, event: dict) -> None:
        if event.get("event") == "compiling":
            self.compiling = True
            self.answered.set()

    def run(self, fields: dict[str, Any], grad: bool, checkpoint: bool,
            save: dict[str, str] | None) -> None:
        """The scan, then (gradients wanted) its VJP with zero cotangents;
        save (its wrt field, or none): the scan that keeps saved, and the
        grad that takes it."""
        try:
            res = self.client.call("scan", **fields, **({} if save is None else
                                                        {"save": True, **save}))
            if grad:
                more: dict[str, Any] = {"checkpoint": True} if checkpoint else {}
                if save is not None:
                    more = {"saved": res["saved"], "saved_key": res["saved_key"], **save}
                self.client.call("grad", cot_carry=zeros(res["carry"]),
                                 cot_outputs=zeros(res["outputs"]), **fields, **more)
        except TorchloopError as exc:
            self.error = exc
        except Exception as exc:  # a lost connection: the daemon path says what
            self.error = TorchloopError("IO", str(exc))
        finally:
            self.done = True
            self.answered.set()
            self.client.close()


def tree_map(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """The tree with fn applied to every tensor (the package's tree walk)."""
    from ._call import flatten, unflatten

    leaves: list[torch.Tensor] = []
    tdef = flatten(tree, "tree", leaves)
    return unflatten(tdef, [fn(t) for t in leaves], [0])


def zeros(tree: Any) -> Any:
    """The tree with every tensor replaced by zeros of its shape."""
    return tree_map(torch.zeros_like, tree)


def copied(tree: Any) -> Any:
    """The tree's tensors copied (detached): the thread sends them while
    the solver goes on with its own."""
    return tree_map(lambda t: t.detach().clone(), tree)


class EagerFirst:
    """The specializations a driver compiles in the background, by key."""

    def __init__(self, socket: str | None) -> None:
        self.socket = socket
        self.ready: set[Key] = set()
        self.pending: dict[Key, _Background] = {}
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.eager_scans = 0  # scans this process ran eagerly

    @staticmethod
    def key(name: str, leaves: Sequence[torch.Tensor], grad: bool, checkpoint: bool) -> Key:
        return (name, grad, checkpoint, leaves[0].dtype,
                tuple(tuple(t.shape) for t in leaves))

    def runs_eagerly(self, key: Key, fields: Callable[[], dict[str, Any]], grad: bool,
                     checkpoint: bool, save: dict[str, str] | None = None) -> bool:
        """Whether this scan runs in process: its specialization is being
        compiled (a first scan starts that compile from a thread, with the
        request fields() gives, and waits until the daemon says whether it
        compiles)."""
        if key in self.ready:
            return False
        with self.lock:
            if os.getpid() != self.pid:  # a forked child: the threads stayed behind
                self.pending.clear()
                self.pid = os.getpid()
            bg = self.pending.get(key)
            if bg is None:
                bg = self.pending[key] = _Background(self.socket)
                threading.Thread(target=bg.run,
                                 args=(fields(), grad, checkpoint, save if grad else None),
                                 daemon=True,
                                 name="torchloop-eager-first").start()
        bg.answered.wait()
        if not bg.done:
            self.eager_scans += 1
            return True
        with self.lock:
            self.pending.pop(key, None)
            if bg.error is None:
                self.ready.add(key)
        return False  # the daemon answers now (or gives its error)


def eager_scan(body: Callable[..., Any], carry: Any, inputs_def: Any,
               xs: Sequence[torch.Tensor]) -> tuple[Any, Any]:
    """The reference's eager loop: the body T times, the ys stacked."""
    from ._call import flatten, unflatten

    ys: list[list[torch.Tensor]] = []
    y_def: Any = None
    for i in range(xs[0].shape[0]):
        carry, y = body(carry, unflatten(inputs_def, [t[i] for t in xs], [0]))
        leaves: list[torch.Tensor] = []
        y_def = flatten(y, "outputs", leaves)
        ys.append(leaves)
    stacked = [torch.stack([row[j] for row in ys]) for j in range(len(ys[0]))]
    return carry, unflatten(y_def, stacked, [0])

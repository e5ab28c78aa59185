"""Local runs (loop_adapter(run="local")): the daemon's compiled graph, run in
the solver's own process.

The daemon stays the compile service, the cache and the registry: a
specialization is asked for with the `artifact` op (the scan's request,
compiled there if new, with the same budget and identity), whose reply holds
the artifact's bytes and its calling convention (docs/protocol.md).  Here it
is written to a private file, loaded with torch's AOTI runner (the C entry
points the daemon drives, through libtorch), and run on this process's
threads: data inputs (carry leaves, then the captured tensors the graph
carries as params, then the input leaves), then one result buffer per output;
the outputs are the final carry's leaves (params included, dropped here) and
the stacked outputs'.  An artifact whose kernels index with data exports the
index-fault flag (worker index_guard.py): it is cleared before each run and
read after, as the daemon's engine does, so an index out of range raises the
daemon's INDEX_OUT_OF_RANGE here too.

Whatever stops a local run before it starts (torch differs from the
daemon's, the artifact does not load here, an adapter the daemon runs only)
is said once per adapter, as a warning with the reason, and that adapter's
scans go through the daemon: a fallback, never a failure.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import threading
import time
import warnings
from typing import TYPE_CHECKING, Optional, Protocol, Sequence, Union

import torch

from ._checks import run_checks
from ._graph import Doc
from .errors import TorchloopError, TorchloopIndexError, TorchloopLinAlgError

if TYPE_CHECKING:
    from .client import Client


class _Sender(Protocol):
    """What a LocalRuns needs of its driver (adapter._Driver)."""

    client: "Client"

    def send(self, op: str, target: Doc, **fields: object) -> dict: ...


class _PairCall(Protocol):
    """What the saved pair's local runs read of a scan (_call._Call)."""

    @property
    def target(self) -> object: ...  # a Doc: _Call.local_save checks it

    carry_def: object
    inputs_def: object
    n_carry: int
    n_params: int
    n_final: int

# engine.c's fault_fail, bit by bit (worker index_guard.py FAULT_*)
INDEX_MESSAGE = ("an index the graph read from its inputs is out of range (as eager torch's "
                 "'index out of bounds'); no result was returned")
LINALG_MESSAGE = ("a linear-algebra op of the graph met a singular (or, for a Cholesky "
                  "factorization, non-positive-definite) matrix, as eager torch's "
                  "torch.linalg.LinAlgError; no result was returned")


def fault_error(bits: int) -> TorchloopError:
    """What the daemon answers for a run whose fault flag is bits."""
    if bits & 1:
        return TorchloopIndexError("INDEX_OUT_OF_RANGE", INDEX_MESSAGE)
    if bits & 4:
        return TorchloopLinAlgError("LINALG_ERROR", LINALG_MESSAGE)
    return TorchloopError("ENGINE_ERROR", "an assertion in the graph failed")

Spec = Union[None, dict[str, object]]


def unflatten(tdef: object, leaves: list[torch.Tensor], pos: list[int]) -> object:
    from ._call import unflatten as tree  # the package's own tree walk

    return tree(tdef, leaves, pos)


def from_spec(spec: Spec, leaves: list[torch.Tensor], pos: list[int]) -> object:
    """The tree of a spec (the worker's form: {"k": "T"|"tuple"|"list"|"dict",
    "c": [...], "keys": [...]}, None) over leaves, from pos[0] on."""
    if spec is None:
        return None
    kind = spec["k"]
    if kind == "T":
        pos[0] += 1
        return leaves[pos[0] - 1]
    children = [from_spec(c, leaves, pos) for c in spec["c"]]  # type: ignore[attr-defined]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    return dict(zip(spec["keys"], children))  # type: ignore[call-overload]


class LocalGraph:
    """One specialization's artifact, loaded in this process."""

    def __init__(self, reply: dict, dtype: torch.dtype) -> None:
        so = reply["so"]
        folder = tempfile.mkdtemp(prefix="torchloop-local-")  # 0700, this process's
        path = os.path.join(folder, "graph.so")
        try:
            with open(path, "wb") as f:
                f.write(so)
            self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(path, 1)
            # the same object (dlopen finds it loaded): its exported flag, if any
            lib = ctypes.CDLL(path)
            try:
                self.fault: Optional[ctypes.c_int] = ctypes.c_int.in_dll(lib, "torchloop_index_fault")
            except ValueError:
                self.fault = None
        finally:
            if os.path.exists(path):
                os.unlink(path)
            os.rmdir(folder)
        self.key: str = reply["key"]
        self.signature: str = reply["signature"]
        self.n_inputs: int = reply["n_inputs"]
        self.n_carry_out: int = reply["n_carry_out"]
        self.saved_key: str = reply.get("saved_key", "")
        self.in_shapes = [tuple(s) for s in reply.get("inputs", [])]
        self.shapes = [tuple(s) for s in reply["outputs"]]
        self.y_spec: Spec = reply["y"]
        self.dtype = dtype
        self.lock = threading.Lock()  # the flag is the artifact's, one per process
        self.us: list[float] = []  # run times since the last report (at most REPORT_SAMPLES)
        self.runs = 0  # since the last report
        self.paused = False  # an upgrade's trial: the daemon runs it (LocalRuns.report)

    def run(self, inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(final carry leaves with params, the other results)."""
        if len(inputs) != self.n_inputs:
            raise RuntimeError(f"the local graph takes {self.n_inputs} inputs, not {len(inputs)}")
        bufs = [torch.empty(s, dtype=self.dtype) for s in self.shapes]
        args = [t.detach().contiguous() for t in inputs] + bufs
        start = time.perf_counter()
        if self.fault is None:
            outs = self.runner.run(args)
        else:
            with self.lock:
                self.fault.value = 0
                outs = self.runner.run(args)
                faulted = self.fault.value
            if faulted:
                raise fault_error(faulted)
        self.runs += 1
        if len(self.us) < REPORT_SAMPLES:
            self.us.append((time.perf_counter() - start) * 1e6)
        return outs[:self.n_carry_out], outs[self.n_carry_out:]

    def taken(self) -> dict[str, object]:
        """This graph's report since the last one (op `report`), then reset."""
        us = sorted(self.us) or [0.0]
        entry: dict[str, object] = {
            "signature": self.signature, "runs": self.runs,
            "p50_us": us[len(us) // 2], "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))]}
        self.us, self.runs = [], 0
        return entry


TORCH = torch.__version__  # what an artifact must have been built by (the daemon's worker)
REPORT_SAMPLES = 4096  # run times kept between two reports
REPORT_EVERY = 1.0  # seconds between two reports (at most; tests set 0)


class LocalRuns:
    """A driver's local graphs: per (graph adapter, T) its LocalGraph, and the
    adapters whose scans go through the daemon (why: said once)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[str, int], LocalGraph] = {}
        # the saved pair's graphs, per (adapter, T, kind, wrt): not reported
        # (a saved pair is the unrolled loop: no quick tier, no upgrade)
        self.pairs: dict[tuple[str, int, str, str], LocalGraph] = {}
        self.off: dict[str, str] = {}
        self.lock = threading.Lock()
        self.reported = time.monotonic()
        self.report_every = REPORT_EVERY

    def scan(self, driver: "_Sender", target: Doc, carry: object, inputs: object,
             leaves: list[torch.Tensor], n_carry: int, params: list[torch.Tensor],
             carry_def: object) -> Optional[tuple[object, object]]:
        """(final carry, outputs) run here, or None: run it through the daemon."""
        key = (target.name, leaves[n_carry].shape[0])
        if time.monotonic() - self.reported >= self.report_every:
            self.report(driver)
        g = self.graphs.get(key)
        if g is not None and g.paused:
            return None
        if g is None:
            if target.name in self.off:
                return None
            g = self._load(driver, target, dict(carry=carry, inputs=inputs,
                                                params=tuple(params)), leaves[0].dtype)
            if g is None:
                return None
            with self.lock:
                self.graphs[key] = g
        carry_out, ys = g.run(leaves[:n_carry] + list(params) + leaves[n_carry:])
        y = from_spec(g.y_spec, ys, [0])
        if target.checks:  # the body's y, then its linalg checks' infos (_checks.py)
            y = run_checks(y, target.checks)
        return unflatten(carry_def, carry_out[:n_carry], [0]), y

    def _load(self, driver: "_Sender", target: Doc, fields: dict[str, object],
              dtype: torch.dtype) -> Optional[LocalGraph]:
        try:  # compiled now if new, as a scan would be
            reply = driver.send("artifact", target, **fields)
        except TorchloopError as exc:
            if exc.code in ("INVALID_ARGUMENT", "UNKNOWN_OP", "PERMISSION_DENIED",
                            "FRAME_TOO_LARGE"):
                # the daemon runs it only (or it is another user's graph, or
                # its artifact is over --max-frame)
                self._fall_back(target.name, exc.message)
            return None  # a failure the daemon's scan reports the same way
        built = getattr(driver.client, "daemon_torch", None)
        if built != TORCH:
            self._fall_back(target.name, f"its graphs are built by torch {built}, this "
                                         f"process has torch {TORCH}")
            return None
        try:
            return LocalGraph(reply, dtype)
        except (OSError, RuntimeError) as exc:
            self._fall_back(target.name, f"its artifact does not load here ({exc})")
            return None

    def pair_graph(self, driver: "_Sender", call: "_PairCall", kind: str,
                   leaves: tuple[torch.Tensor, ...], wrt: dict[str, str]) -> Optional[LocalGraph]:
        """The saved pair's graph of kind (scan_save, grad_saved) for call's
        specialization (leaves: carry, inputs, then the captured tensors)."""
        target = call.target
        assert isinstance(target, Doc)
        n_in = len(leaves) - call.n_params
        key = (target.name, leaves[call.n_carry].shape[0], kind, wrt.get("wrt", ""))
        g = self.pairs.get(key)
        if g is None and target.name not in self.off:
            fields: dict[str, object] = dict(
                carry=unflatten(call.carry_def, list(leaves), [0]),
                inputs=unflatten(call.inputs_def, list(leaves[call.n_carry:n_in]), [0]),
                params=tuple(t.detach() for t in leaves[n_in:]), kind=kind, **wrt)
            g = self._load(driver, target, fields, leaves[0].dtype)
            if g is not None:
                with self.lock:
                    self.pairs[key] = g
        return g

    def scan_save(self, driver: "_Sender", call: "_PairCall", leaves: tuple[torch.Tensor, ...],
                  wrt: dict[str, str]) -> Optional[dict[str, object]]:
        """A scan with save run here: the daemon's reply's fields, or None."""
        g = self.pair_graph(driver, call, "scan_save", leaves, wrt)
        if g is None:
            return None
        n_in = len(leaves) - call.n_params
        carry, rest = g.run([*leaves[:call.n_carry], *leaves[n_in:], *leaves[call.n_carry:n_in]])
        y = from_spec(g.y_spec, rest[:-1], [0])
        checks = call.target.checks if isinstance(call.target, Doc) else ()
        if checks:
            y = run_checks(y, checks)
        return {"carry": unflatten(call.carry_def, carry[:call.n_carry], [0]), "outputs": y,
                "saved": rest[-1], "saved_key": g.saved_key}

    def grad_saved(self, driver: "_Sender", call: "_PairCall", leaves: tuple[torch.Tensor, ...],
                   cots: Sequence[Optional[torch.Tensor]], saved: torch.Tensor,
                   wrt: dict[str, str]) -> Optional[list[torch.Tensor]]:
        """The backward of a local scan_save, run here: the gradients in the
        order _ScanFunction returns them (carry, inputs, captured tensors)."""
        g = self.pair_graph(driver, call, "grad_saved", leaves, wrt)
        if g is None:
            return None
        nc, n_in = call.n_carry, len(leaves) - call.n_params
        data = [*leaves[:nc], *leaves[n_in:], *leaves[nc:n_in], saved]
        # cotangents: the final carry's (the captured tensors': zero), the
        # outputs' (the linalg checks' infos: zero)
        given = [*cots[:call.n_final], *[None] * call.n_params, *cots[call.n_final:]]
        given += [None] * (g.n_inputs - len(data) - len(given))
        data += [c if c is not None else torch.zeros(s, dtype=g.dtype)
                 for c, s in zip(given, g.in_shapes[len(data):])]
        first, rest = g.run(data)  # the carry's (with the captured tensors'), the inputs'
        grads = [*first, *rest]
        return [*grads[:nc], *grads[nc + call.n_params:], *grads[nc:nc + call.n_params]]

    def report(self, driver: "_Sender") -> None:
        """Tells the daemon what the local runs did (op `report`, per graph
        adapter) and learns what changed: a graph whose specialization now
        serves another artifact (an upgrade took over, or was reverted) is
        dropped and fetched again at its next scan; during an upgrade's
        trial, which the daemon decides on its own runs, scans go to it."""
        self.reported = time.monotonic()
        with self.lock:
            by_name: dict[str, list[LocalGraph]] = {}
            for (name, _), g in self.graphs.items():
                by_name.setdefault(name, []).append(g)
        for name, graphs in by_name.items():
            try:
                reply = driver.client.call("report", adapter=name,
                                           specs=[g.taken() for g in graphs])
            except TorchloopError:
                continue  # a daemon that forgot the adapter: the next scan registers it
            now = {s["signature"]: s for s in reply["specs"]}
            for g in graphs:
                s = now.get(g.signature)
                g.paused = bool(s and s["trial"])
                if s is not None and not g.paused and s["key"] != g.key:
                    with self.lock:  # the next scan fetches the current artifact
                        self.graphs = {k: v for k, v in self.graphs.items() if v is not g}

    def _fall_back(self, name: str, why: str) -> None:
        with self.lock:
            if name in self.off:
                return
            self.off[name] = why
        warnings.warn(f"torchloop: run='local' for adapter {name} runs through the daemon "
                      f"instead: {why}", RuntimeWarning, stacklevel=4)

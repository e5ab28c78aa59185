"""torchloopd compile worker: one long-lived Python process per daemon.

It speaks the daemon's framing (4-byte big-endian length + one msgpack map)
on stdin/stdout and never sees a client socket. Each job compiles one scan
specialization -- (tree structure, leaf shapes, dtype, T, kind) of one
adapter body -- with torch.export + AOTInductor into a bare shared object,
and replies with the graph's flat signature. stderr is the worker's log.

The compiled graph is flat: its inputs are the tensor leaves of carry then
inputs (None leaves dropped, depth-first, dict order kept), and its outputs
the tensor leaves of the final carry then of the stacked outputs (then, for
kind "vjp" and "vjp_checkpoint", the gradients for the carry's and the
inputs' tensor leaves; checkpoint.py builds the latter).
The daemon owns the trees; the graph only sees tensors.

Errors map to protocol codes (proto/protocol.h); nothing falls back to eager.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib.util
import math
import os
import shutil
import signal
import struct
import sys
import time
import traceback
import types
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import msgpack
import torch

# the loader of captured graphs lives beside this file, however it was started
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoint  # noqa: E402
from blocked import block_size, blocked, graph_ops  # noqa: E402
import graph_loader  # noqa: E402
from graph_loader import GraphBody, GraphError  # noqa: E402

MIN_TORCH = (2, 14)
PROTOCOL = 1


class JobError(Exception):
    """A compile failure with a protocol error code and a leaf path."""

    def __init__(self, code: str, message: str, path: str = "", transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path
        # A failure of the machine, not of the body (disk full, I/O error, out of
        # memory): the daemon must not remember it against the specialization.
        self.transient = transient

    def reply(self, rid: Any) -> dict[str, Any]:
        err = {"code": self.code, "message": self.message, "path": self.path}
        if self.transient:
            err["transient"] = True
        return {"id": rid, "error": err}


# ---- framing ---------------------------------------------------------------


def read_frame(stream: Any) -> dict[str, Any] | None:
    head = stream.read(4)
    if not head:
        return None
    if len(head) < 4:
        raise EOFError("truncated frame header")
    (length,) = struct.unpack(">I", head)
    body = stream.read(length)
    if len(body) < length:
        raise EOFError("truncated frame body")
    msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(msg, dict):
        raise ValueError("frame is not a map")
    return msg


def write_frame(stream: Any, msg: dict[str, Any]) -> None:
    body = msgpack.packb(msg, use_bin_type=True)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def log(msg: str) -> None:
    print(f"worker[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


# ---- specs: tree structure + leaf shapes, as the daemon sends them ---------
#
# A spec node is None, {"k": "T", "s": [dims]}, {"k": "tuple"|"list", "c": [...]}
# or {"k": "dict", "keys": [...], "c": [...]}.


def spec_path(path: str, node: dict[str, Any], i: int) -> str:
    if node["k"] == "dict":
        return f'{path}["{node["keys"][i]}"]'
    return f"{path}[{i}]"


def spec_leaves(spec: Any) -> list[list[int]]:
    """Shapes of the tensor leaves in depth-first order."""
    if spec is None:
        return []
    if spec["k"] == "T":
        return [list(spec["s"])]
    out: list[list[int]] = []
    for child in spec["c"]:
        out.extend(spec_leaves(child))
    return out


def spec_build(spec: Any, leaves: list[Any], pos: list[int]) -> Any:
    """Rebuilds a tree of spec's structure from a flat leaf list."""
    if spec is None:
        return None
    kind = spec["k"]
    if kind == "T":
        leaf = leaves[pos[0]]
        pos[0] += 1
        return leaf
    children = [spec_build(c, leaves, pos) for c in spec["c"]]
    if kind == "tuple":
        return tuple(children)
    if kind == "list":
        return children
    return dict(zip(spec["keys"], children))


def tree_spec(tree: Any, path: str) -> Any:
    """The spec of a tree the body returned; refuses non-tensor leaves."""
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return {"k": "T", "s": list(tree.shape), "dtype": str(tree.dtype).removeprefix("torch.")}
    if isinstance(tree, tuple):
        return {"k": "tuple", "c": [tree_spec(v, f"{path}[{i}]") for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return {"k": "list", "c": [tree_spec(v, f"{path}[{i}]") for i, v in enumerate(tree)]}
    if isinstance(tree, dict):
        for key in tree:
            if not isinstance(key, str):
                raise JobError("BODY_ERROR", f"{path}: dict keys must be strings", path)
        return {
            "k": "dict",
            "keys": list(tree.keys()),
            "c": [tree_spec(v, f'{path}["{k}"]') for k, v in tree.items()],
        }
    raise JobError(
        "BODY_ERROR",
        f"{path}: the body returned a {type(tree).__name__}; "
        "leaves must be tensors or None",
        path,
    )


def flat_tensors(tree: Any) -> list[Any]:
    if tree is None:
        return []
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree
    out: list[Any] = []
    for v in values:
        out.extend(flat_tensors(v))
    return out


def strip_dtype(spec: Any) -> Any:
    if spec is None:
        return None
    if spec["k"] == "T":
        return {"k": "T", "s": spec["s"]}
    out = {"k": spec["k"], "c": [strip_dtype(c) for c in spec["c"]]}
    if spec["k"] == "dict":
        out["keys"] = spec["keys"]
    return out


# ---- symbolic batch (adapter option dynamic = batch) ------------------------
#
# The daemon marks the batch dimension of a spec with -1: dimension 0 of every
# carry leaf, dimension 1 (after T) of every input leaf. The graph is exported
# with that dimension symbolic (one torch.export Dim shared by every leaf), so
# it serves every batch size from 1 to the job's max_batch. The eager dry run
# and the tracer see concrete probe sizes: small primes that equal no other
# dimension of the job (so no size can be mistaken for the batch) and are not
# 0 or 1 (which torch specializes).

BATCH = -1


def spec_has_batch(spec: Any) -> bool:
    return any(BATCH in s for s in spec_leaves(spec))


def spec_bind(spec: Any, batch: int) -> Any:
    """The spec with its batch dimensions set to batch."""
    if spec is None:
        return None
    if spec["k"] == "T":
        return {**spec, "s": [batch if d == BATCH else d for d in spec["s"]]}
    return {**spec, "c": [spec_bind(c, batch) for c in spec["c"]]}


def probe_batches(carry: Any, inputs: Any, steps: int) -> tuple[int, int]:
    """Two batch sizes to trace and check with: primes >= 3 that differ from
    every other dimension of the job (and T). They may exceed the adapter's
    largest batch size: the worker's probe tensors are not bounded by it."""
    taken = {steps} | {d for s in spec_leaves(carry) + spec_leaves(inputs) for d in s}
    found: list[int] = []
    p = 3
    while len(found) < 2:
        if all(p % q for q in range(2, int(p ** 0.5) + 1)) and p not in taken:
            found.append(p)
        p += 1
    return found[0], found[1]


def batch_y_spec(y1: Any, y2: Any, b1: int, b2: int, path: str = "outputs") -> Any:
    """The per-step output spec with -1 where it follows the batch size, from
    the dry runs at b1 and b2; any other size that changes with the batch is
    refused (the graph's buffers are laid out from this spec)."""
    if y1 is None:
        return None
    if y1["k"] == "T":
        dims = []
        for i, (d1, d2) in enumerate(zip(y1["s"], y2["s"])):
            if d1 == d2:
                dims.append(d1)
            elif (d1, d2) == (b1, b2):
                dims.append(BATCH)
            else:
                raise JobError(
                    "BATCH_SPECIALIZED",
                    f"{path}: dimension {i} is {d1} at batch size {b1} and {d2} at {b2}; with "
                    "dynamic = batch an output's sizes must be constant or the batch size "
                    "itself",
                    path,
                )
        return {**y1, "s": dims}
    return {**y1, "c": [batch_y_spec(c1, c2, b1, b2, spec_path(path, y1, i))
                        for i, (c1, c2) in enumerate(zip(y1["c"], y2["c"]))]}


def carry_mismatch(expected: Any, actual: Any, path: str, dtype: str) -> str | None:
    """First difference between the carry spec and what the body returned."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        return f"{path}: expected {describe(expected)}, got {describe(actual)}"
    if expected["k"] != actual["k"]:
        return f"{path}: expected {describe(expected)}, got {describe(actual)}"
    if expected["k"] == "T":
        if list(expected["s"]) != list(actual["s"]):
            return f"{path}: expected shape {tuple(expected['s'])}, got {tuple(actual['s'])}"
        if actual.get("dtype") != dtype:
            return f"{path}: expected dtype {dtype}, got {actual.get('dtype')}"
        return None
    if expected["k"] == "dict" and list(expected["keys"]) != list(actual["keys"]):
        return f"{path}: expected keys {expected['keys']}, got {actual['keys']}"
    if len(expected["c"]) != len(actual["c"]):
        return (
            f"{path}: expected a {expected['k']} of {len(expected['c'])}, "
            f"got {len(actual['c'])}"
        )
    for i, (e, a) in enumerate(zip(expected["c"], actual["c"])):
        found = carry_mismatch(e, a, spec_path(path, expected, i), dtype)
        if found:
            return found
    return None


def describe(spec: Any) -> str:
    if spec is None:
        return "None"
    if spec["k"] == "T":
        return f"a tensor of shape {tuple(spec['s'])}"
    return f"a {spec['k']}"


def first_path(message: str) -> str:
    return message.split(":", 1)[0] if message.startswith("carry") else ""


# ---- the body ---------------------------------------------------------------


# A spec node as the daemon sends it (see above); None for a None leaf.
Spec = dict[str, Any] | None


# Job kinds -> whether the graph is a VJP (takes the cotangents after the
# inputs, returns the gradients after the outputs); the daemon's spec kinds
# (daemon/graphs.c, SPEC_KINDS) name them.
KINDS = {"forward": False, "vjp": True, "vjp_checkpoint": True}


@dataclass(frozen=True)
class Job:
    """One compile (or register-time check) request from the daemon."""

    body_source: str
    body_file: str
    entry: str
    body_graph: str = ""  # a captured step graph (graph_loader.py) instead of source
    strategy: str = "unroll"
    kind: str = "forward"  # a key of KINDS
    dtype: str = "float64"
    steps: int = 0
    max_batch: int = 0  # dynamic = batch: the largest batch size; specs mark it -1
    output: str = ""
    carry: Spec = None
    inputs: Spec = None
    strict: bool = False
    # the requesting scan's own inputs (one buffer per carry then input leaf)
    # for the dry run and the parity check; None: random ones
    sample: list[bytes] | None = None

    @classmethod
    def parse(cls, req: dict[str, Any]) -> Job:
        """The fields of a compile/check request; missing optional ones get defaults."""
        try:
            job = cls(
                body_source=str(req.get("body_source", "")),
                body_file=str(req.get("body_file") or "<adapter>"),
                entry=str(req.get("entry", "")),
                body_graph=str(req.get("body_graph", "")),
                strategy=str(req.get("strategy", "unroll")),
                kind=str(req.get("kind", "forward")),
                dtype=str(req.get("dtype", "float64")),
                steps=int(req.get("steps", 0)),
                max_batch=int(req.get("max_batch", 0) or 0),
                output=str(req.get("output", "")),
                carry=req.get("carry"),
                inputs=req.get("inputs"),
                strict=bool(req.get("strict", False)),
                sample=parse_sample(req.get("sample")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise JobError("COMPILE_FAILED", f"malformed job from the daemon: {exc!r}") from exc
        if job.kind not in KINDS:
            raise JobError("COMPILE_FAILED", f"malformed job from the daemon: kind {job.kind!r}")
        k = block_size(job.strategy)
        if job.strategy not in ("unroll", "scan") and (
                not 2 <= k < max(job.steps, 2) or job.kind != "forward"):
            raise JobError("COMPILE_FAILED",
                           f"malformed job from the daemon: strategy {job.strategy!r} "
                           f"for {job.steps} steps")
        return job


def parse_sample(sample: object) -> list[bytes] | None:
    if sample is None:
        return None
    if not isinstance(sample, list) or not all(isinstance(b, bytes) for b in sample):
        raise TypeError("sample is not a list of byte strings")
    return sample


GRAPHS: dict[str, GraphBody] = {}  # graph text's digest -> loaded body (bounded below)


def load_graph(text: str) -> GraphBody:
    """A captured graph, loaded (checked, never executed as code) once per content."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    body = GRAPHS.get(digest)
    if body is None:
        try:
            body = graph_loader.load(text)
        except GraphError as exc:
            raise JobError(exc.code, exc.message, exc.path) from None
        if len(GRAPHS) >= 64:
            GRAPHS.pop(next(iter(GRAPHS)))
        GRAPHS[digest] = body
    return body


def load_body(job: Job) -> Callable[..., Any]:
    """Imports the body's module under a name unique to its source (or loads
    a captured graph)."""
    if job.body_graph:
        return load_graph(job.body_graph)
    source, filename = job.body_source, job.body_file
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"torchloop_body_{digest}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_loader(name, loader=None, origin=filename)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = filename
        try:
            exec(compile(source, filename, "exec"), module.__dict__)
        except Exception as exc:  # the adapter's own module failed to import
            raise JobError("BODY_ERROR", f"importing {filename}: {exc!r}") from exc
        sys.modules[name] = module
    fn = getattr(module, job.entry, None)
    if not callable(fn):
        raise JobError("BODY_ERROR", f"{filename} has no function {job.entry!r}")
    return fn


@dataclass
class Scan:
    """One specialization's scan over flat tensors (the graph to compile)."""

    body: Callable[..., Any]
    carry_spec: Spec
    inputs_spec: Spec
    steps: int
    dtype: str
    strategy: str
    y_spec: Spec = None
    tracing: bool = False  # False: the eager dry run, where failures are the body's
    # what the graph turned out to be, and why when it is not what the strategy
    # asked for (reported in the compile reply, describe and the log)
    lowered: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def n_carry(self) -> int:
        return len(spec_leaves(self.carry_spec))

    def step(self, carry: Any, x: Any, t: int) -> tuple[Any, Any]:
        try:
            out = self.body(carry, x)
        except JobError:
            raise
        except GraphError as exc:  # a request that does not fit the captured graph
            raise JobError(exc.code, exc.message, exc.path) from None
        except Exception as exc:
            if self.tracing:
                raise  # the body ran eagerly at this step: a capture problem
            raise JobError("BODY_ERROR", f"the body raised at step {t}: {exc!r}") from exc
        if not isinstance(out, tuple) or len(out) != 2:
            raise JobError(
                "BODY_ERROR",
                f"the body must return (new_carry, y); it returned {type(out).__name__} "
                f"at step {t}",
            )
        new_carry, y = out
        if self.tracing:
            # checked in the eager dry run; comparing a symbolic batch size with
            # the spec's here would pin it to the probe size
            return new_carry, y
        found = carry_mismatch(
            self.carry_spec, tree_spec(new_carry, "carry"), "carry", self.dtype
        )
        if found:
            raise JobError(
                "CARRY_MISMATCH",
                f"{found} (the body must keep the carry's structure, shapes and dtype; "
                f"step {t})",
                first_path(found),
            )
        return new_carry, y

    def forward(self, *flat: Any, lifted: list[Any] | None = None) -> tuple[Any, ...]:
        """lifted: the values of the body's captured tensors for the scan op
        (FlatModule's buffers under torch.export); None: the tensors themselves."""
        carry = spec_build(self.carry_spec, list(flat[: self.n_carry]), [0])
        xs = spec_build(self.inputs_spec, list(flat[self.n_carry :]), [0])
        if self.strategy == "unroll":
            return self.unrolled(carry, xs)
        k = block_size(self.strategy)
        if k:
            step, captured = self.flat_step(clone=False)
            return blocked(step, self.n_carry, self.steps, k, flat_tensors(carry),
                           flat_tensors(xs), captured if lifted is None else lifted)
        return self.hop(carry, xs, lifted)

    def unrolled(self, carry: Any, xs: Any) -> tuple[Any, ...]:
        ys = []
        for t in range(self.steps):
            x_t = map_tensors(xs, lambda leaf, t=t: leaf[t])
            carry, y = self.step(carry, x_t, t)
            ys.append(y)
        self.y_spec = tree_spec(ys[0], "outputs")
        columns = [flat_tensors(y) for y in ys]
        stacked = [torch.stack([col[i] for col in columns]) for i in range(len(columns[0]))]
        return tuple(flat_tensors(carry)) + tuple(stacked)

    def hop(self, carry: Any, xs: Any, lifted: list[Any] | None = None) -> tuple[Any, ...]:
        """torch's scan higher-order op: Inductor lowers it to a while loop.

        Its combine function must be pure and see tensors only, so it takes
        and returns flat leaf lists and rebuilds the trees (None leaves
        included) inside; the structural checks ran in the eager dry run.
        Tensors the body captures from its module are lifted into the op's
        additional inputs: the combine function runs the body (and its
        module's helpers) over a copy of the module's globals in which those
        names are bound to the op's traced inputs, so the body's code is unchanged.
        """
        from torch._higher_order_ops.scan import scan_op

        combine, captured = self.flat_step(clone=True)
        if lifted is None:
            lifted = captured
        return tuple(scan_op(combine, flat_tensors(carry), flat_tensors(xs), tuple(lifted)))

    def flat_step(self, clone: bool) -> tuple[Callable[..., list[Any]], list[Any]]:
        """(the step over flat leaves, the tensors the body captures from its
        module): step(*carry leaves, *x leaves, *lifted) -> [*new carry, *y].
        clone: every result a new tensor (the scan op refuses outputs that
        alias its inputs or each other, `return c, c`)."""
        carry_spec, inputs_spec, body = self.carry_spec, self.inputs_spec, self.body
        nc, nx = len(spec_leaves(carry_spec)), len(spec_leaves(inputs_spec))
        captured = captured_tensors(body)
        names = [n for n, _ in captured]

        def step(*flat: Any) -> list[Any]:
            c = spec_build(carry_spec, list(flat[:nc]), [0])
            x = spec_build(inputs_spec, list(flat[nc : nc + nx]), [0])
            fn = rebound(body, dict(zip(names, flat[nc + nx :]))) if names else body
            new_c, y = fn(c, x)
            res = flat_tensors(new_c) + flat_tensors(y)
            return [t.clone() for t in res] if clone else res

        return step, [t for _, t in captured]


def rebound(fn: Callable[..., Any], values: dict[str, Any]) -> Callable[..., Any]:
    """fn over a copy of its module's globals where each name in values is
    that value instead; the module's other functions (the body's helpers)
    are rebound to the same copy, so they see the values too.  A captured
    graph takes its constants' values directly."""
    if isinstance(fn, GraphBody):
        return fn.with_tensors(values)
    g = dict(fn.__globals__)
    g.update(values)
    home = fn.__globals__

    def copy(f: Any) -> Any:
        new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
        new.__kwdefaults__ = f.__kwdefaults__
        new.__dict__.update(f.__dict__)
        return new

    for k, v in list(g.items()):
        if isinstance(v, types.FunctionType) and v.__globals__ is home and k not in values:
            g[k] = copy(v)
    return copy(fn)


def captured_tensors(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """Module-level tensors the body's module refers to by name: the globals
    named in the code of any function defined in that module (the body's own
    helpers included), in a stable order.  A captured graph's are its constants."""
    if isinstance(fn, GraphBody):
        return fn.lifted_tensors()
    g = getattr(fn, "__globals__", {})
    mod = getattr(fn, "__module__", None)
    names: set[str] = set()

    def walk(code: Any) -> None:
        names.update(code.co_names)
        for k in code.co_consts:
            if hasattr(k, "co_names"):
                walk(k)

    for v in list(g.values()):
        code = getattr(v, "__code__", None)
        if code is not None and getattr(v, "__module__", None) == mod:
            walk(code)
    return [(n, g[n]) for n in sorted(names) if isinstance(g.get(n), torch.Tensor)]


def map_tensors(tree: Any, fn: Callable[[Any], Any]) -> Any:
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(map_tensors(v, fn) for v in tree)
    if isinstance(tree, list):
        return [map_tensors(v, fn) for v in tree]
    return {k: map_tensors(v, fn) for k, v in tree.items()}


# ---- error classification -------------------------------------------------


def classify(exc: BaseException, phase: str) -> JobError:
    """Maps a failure of the export ("capture") or Inductor ("inductor") phase."""
    if isinstance(exc, JobError):
        return exc
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for e in chain:
        if isinstance(e, JobError):
            return e
        if isinstance(e, GraphError):
            return JobError(e.code, e.message, e.path)
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    resource = resource_failure(chain, text)
    if resource is not None:
        return resource
    short = f"{type(exc).__name__}: {str(exc).strip()[:1500]}"
    if "Constraints violated" in text:  # only ever with a symbolic batch
        return JobError(
            "BATCH_SPECIALIZED",
            "dynamic = batch: the body fixes the batch size (it mixes the batch with a tensor "
            "or size of its own), so one graph cannot serve every batch size; register the "
            f"adapter without dynamic = batch to compile one graph per batch size. {short}",
        )
    data_dependent = (
        "data-dependent" in text.lower()
        or "GuardOnDataDependentSymNode" in text
        or "Dynamic control flow" in text
        or "generic_jump" in text
    )
    if data_dependent:
        return JobError(
            "GRAPH_BREAK",
            "the body cannot be captured as one static graph (data-dependent Python control "
            f"flow or shapes): {short}",
        )
    if phase == "capture":
        return JobError(
            "UNSUPPORTED_OP",
            f"the body ran eagerly but uses something torch.export cannot capture: {short}",
        )
    if any("Lowering" in type(e).__name__ or isinstance(e, NotImplementedError) for e in chain):
        return JobError("UNSUPPORTED_OP", f"Inductor cannot compile an op of the body: {short}")
    return JobError("COMPILE_FAILED", f"Inductor failed: {short}")


# errno values and the texts g++/ld print for them: a full disk or a failing
# device is the machine's fault, never the body's.
RESOURCE_ERRNOS = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EIO: "Input/output error",
    errno.ENOMEM: "Cannot allocate memory",
    errno.EMFILE: "Too many open files",
}


def resource_failure(chain: list[BaseException], text: str) -> JobError | None:
    """A transient COMPILE_FAILED whose message starts with the cause.

    The cause goes first because the daemon's messages are bounded and a
    compiler's output puts it last, after pages of command line.
    """
    cause = None
    for e in chain:
        if isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS:
            cause = RESOURCE_ERRNOS[e.errno]
            break
        if isinstance(e, MemoryError):
            cause = RESOURCE_ERRNOS[errno.ENOMEM]
            break
    if cause is None:
        cause = next((t for t in RESOURCE_ERRNOS.values() if t in text), None)
    if cause is None:
        return None
    tail = text.strip().replace("\n", " ")[-600:]
    return JobError(
        "COMPILE_FAILED",
        f"{cause} while compiling (a resource problem of this machine; the next request "
        f"retries): ...{tail}",
        transient=True,
    )


# ---- artifact checks ------------------------------------------------------


PROXY_SYMBOL = b"aoti_torch_proxy_executor_call_function"


def check_artifact(so_path: str, job_dir: str) -> None:
    """Refuses artifacts the C engine cannot (or should not) load.

    An op without a C shim is called through AOTI's C++ proxy executor: the
    generated code imports aoti_torch_proxy_executor_call_function and
    torch 2.14 writes the extern nodes to <key>.wrapper.json in the compile's
    directory (not beside the output .so). Either sign refuses the artifact,
    naming the aten ops from the json.
    """
    with open(so_path, "rb") as f:
        data = f.read()
    jsons = sorted(
        os.path.join(root, name)
        for root, _, names in os.walk(job_dir)
        for name in names
        if name.endswith(".wrapper.json") or name == os.path.basename(so_path)[:-3] + ".json"
    )
    ops = sorted({op for path in jsons for op in extern_ops(path)})
    if ops or PROXY_SYMBOL in dynamic_imports(data):
        raise JobError(
            "PROXY_EXECUTOR_REQUIRED",
            "the graph calls "
            + (", ".join(ops) or "an op without a C shim")
            + " through AOTI's C++ proxy executor, which a C daemon cannot provide; "
            "use ops Inductor lowers or that have a C shim",
        )
    problems = elf_problems(data)
    if b"__cxa_thread_atexit" in dynamic_imports(data):
        problems = ", ".join(filter(None, [problems, "thread-local destructors "
                                           "(__cxa_thread_atexit: the daemon could never "
                                           "unload it)"]))
    if problems:
        raise JobError("UNSAFE_ARTIFACT", f"{os.path.basename(so_path)}: {problems}")


def extern_ops(path: str) -> list[str]:
    """The aten ops of an AOTI extern-node file ({"nodes": [{"node": {"target"}}]})."""
    import json

    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return []
    ops = set()
    for entry in doc.get("nodes", []):
        node = entry.get("node") if isinstance(entry, dict) else None
        target = node.get("target") if isinstance(node, dict) else None
        if isinstance(target, str):
            ops.add(target)
    return sorted(ops)


def dynamic_imports(data: bytes) -> set[bytes]:
    """Names of the undefined symbols in an ELF64 object's .dynsym."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return set()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                for i in range(shnum)]
    names: set[bytes] = set()
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        for off in range(sh[4], sh[4] + sh[5], 24):
            st_name, _, _, st_shndx = struct.unpack_from("<IBBH", data, off)
            if st_shndx == 0 and st_name:
                end = data.index(b"\0", str_off + st_name)
                names.add(data[str_off + st_name:end])
    return names


def gnu_stack_offset(data: bytes) -> int | None:
    """File offset of the PT_GNU_STACK program header's p_flags, if any."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        off = phoff + i * phentsize
        if struct.unpack_from("<I", data, off)[0] == 0x6474E551:
            return off + 4
    return None


def clear_exec_stack(so_path: str) -> bool:
    """Clears PF_X on PT_GNU_STACK (what `execstack -c` does).

    AOTI links an object without a .note.GNU-stack section, so ld marks the
    .so as needing an executable stack although generated C++ never does
    (only GCC's nested-function trampolines need one). Returns True if the
    flag was set and has been cleared.
    """
    with open(so_path, "r+b") as f:
        data = f.read()
        off = gnu_stack_offset(data)
        if off is None:
            return False
        flags, = struct.unpack_from("<I", data, off)
        if not flags & 1:
            return False
        f.seek(off)
        f.write(struct.pack("<I", flags & ~1))
    return True


def unique_symbols(data: bytes) -> int:
    """How many .dynsym entries have STB_GNU_UNIQUE binding (10)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return 0
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    n = 0
    for i in range(shnum):
        sh = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        if sh[1] == 11:  # SHT_DYNSYM
            n += sum(data[off + 4] >> 4 == 10 for off in range(sh[4], sh[4] + sh[5], 24))
    return n


def elf_problems(data: bytes) -> str:
    """Executable stack (PT_GNU_STACK with X), text relocations (DT_TEXTREL),
    or symbols that pin the library in memory for good (STB_GNU_UNIQUE)."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return "not a 64-bit ELF shared object"
    unique = unique_symbols(data)
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    issues = []
    for i in range(phnum):
        off = phoff + i * phentsize
        p_type, p_flags = struct.unpack_from("<II", data, off)
        if p_type == 0x6474E551 and p_flags & 1:  # PT_GNU_STACK, PF_X
            issues.append("executable stack")
        if p_type == 2:  # PT_DYNAMIC
            d_off, = struct.unpack_from("<Q", data, off + 8)
            d_size, = struct.unpack_from("<Q", data, off + 32)
            for j in range(0, d_size, 16):
                tag, val = struct.unpack_from("<qQ", data, d_off + j)
                if tag == 0:
                    break
                if tag == 22 or (tag == 30 and val & 0x4):  # DT_TEXTREL, DF_TEXTREL
                    issues.append("text relocations")
    if unique:
        issues.append(f"{unique} STB_GNU_UNIQUE symbols (the daemon could never unload it)")
    return ", ".join(sorted(set(issues)))


# ---- stacked results straight into the daemon's buffers -------------------
#
# The graphs write their results into buffers they are given (OutModule).  The
# unrolled loop's stacked outputs reach them as copy_(buffer, cat(parts)) --
# torch.stack decomposes to a cat along dim 0 -- and Inductor lowers that as a
# cat into a buffer of its own followed by a copy: one more pass over [T, ...]
# (plain AOTI 204 µs against 310-343 µs for the out-variant at N = 4096,
# T = 128, docs/performance.md).  StackIntoOutputs, a post-grad pass, swaps each
# such copy for torchloop::cat_into_(buffer, parts), whose lowering is
# Inductor's own cat (ConcatKernel.realize_into) over slices of the given
# buffer: every part is computed straight into its rows, as a cat computes its
# parts into its own buffer.  Parts that cannot be placed (an input, a view, a
# part already placed elsewhere) are copied in, as a cat copies them.

CAT_INTO_OPS: list[Any] = []  # the op, once defined in this process


def cat_into_op() -> Any:
    """torchloop::cat_into_(Tensor(a!) dst, Tensor[] parts): dst's elements,
    in order, become the parts' elements, in order (row-major); with its
    Inductor lowering.  Defined once per process."""
    if CAT_INTO_OPS:
        return CAT_INTO_OPS[0]
    import math

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
    def lower(dst: Any, parts: list[Any]) -> None:
        dst.realize()
        storage, layout = ir.as_storage_and_layout(dst, freeze=True)
        offset = layout.offset
        # a NopKernel (as a cat is) that depends on every placed part and
        # marks dst mutated, so the parts are scheduled and kept
        kernel = ir.ConcatKernel(name=None, layout=ir.MutationLayoutSHOULDREMOVE(dst), inputs=[])
        for part in parts:
            size = list(part.get_size())
            rows = ir.ReinterpretView(data=storage, layout=ir.FixedLayout(
                layout.device, layout.dtype, size, ir.FlexibleLayout.contiguous_strides(size),
                offset))
            kernel.inputs.append(ir.ConcatKernel.realize_into(part, rows))
            offset = offset + math.prod(size)
        kernel.name = V.graph.register_buffer(kernel)
        kernel.inputs = ir.ConcatKernel.unwrap_storage(kernel.inputs)
        V.graph.register_operation(kernel)
        V.graph.mark_buffer_mutated(dst.get_name())

    CAT_INTO_OPS.extend([op, lib])  # the library object must outlive the op
    return op


def static_shape(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and all(isinstance(s, int) for s in val.shape)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - torch >= 2.14 has it
    CustomGraphPass = object  # type: ignore[assignment,misc]


class StackIntoOutputs(CustomGraphPass):  # type: ignore[misc,valid-type]
    """Post-grad pass: copy_(P, cat(parts, 0)) -- or copy_(P, view(cat)) --
    where P is a graph input (one of the daemon's result buffers), contiguous,
    of static shape and the cat's dtype and size, becomes cat_into_(P, parts).
    Counts what it rewrote (rewritten)."""

    def __init__(self) -> None:
        self.rewritten = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> StackIntoOutputs:
        # Inductor's config deep-copies what it hands out: one counter
        return self

    def uuid(self) -> Any:
        # Inductor's FX graph cache keys on it: this file's bytes
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def match(self, node: Any) -> tuple[Any, list[Any]] | None:
        aten = torch.ops.aten
        dst, src = node.args[0], node.args[1]
        if getattr(dst, "op", None) != "placeholder" or not hasattr(src, "target"):
            return None
        cat = src
        if cat.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            if len(cat.users) != 1 or not hasattr(cat.args[0], "target"):
                return None
            cat = cat.args[0]
        if cat.target is not aten.cat.default or len(cat.users) != 1:
            return None
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        out, whole = dst.meta.get("val"), cat.meta.get("val")
        parts = list(cat.args[0])
        vals = [getattr(p, "meta", {}).get("val") for p in parts]
        if (dim != 0 or not static_shape(out) or not static_shape(whole)
                or not out.is_contiguous() or out.dtype != whole.dtype
                or out.device.type != "cpu" or out.numel() != whole.numel()
                or not all(static_shape(v) and v.dtype == out.dtype for v in vals)):
            return None
        return cat, parts

    def __call__(self, graph: Any) -> None:
        for node in list(graph.nodes):
            if node.target is not torch.ops.aten.copy_.default:
                continue
            found = self.match(node)
            if found is None:
                continue
            cat, parts = found
            dst, src = node.args[0], node.args[1]
            with graph.inserting_before(node):
                graph.call_function(cat_into_op(), (dst, parts))
            node.replace_all_uses_with(dst)
            graph.erase_node(node)
            if not src.users:
                graph.erase_node(src)
            if cat is not src and not cat.users:
                graph.erase_node(cat)
            self.rewritten += 1


# ---- the job ---------------------------------------------------------------


def aoti_options(out_path: str, batched: bool = False) -> dict[str, Any]:
    """Inductor options for every artifact; part of the daemon's cache key.

    use_consts_asm_build=False: the assembly route (weights.S) has no
    .note.GNU-stack section, so the linker marks the whole .so as needing an
    executable stack -- dlopen would then make every thread stack of the
    daemon executable (and newer glibc refuses such a library outright).

    check_lowerbound=False for a symbolic batch: Inductor assumes sizes >= 2
    of a symbol (torch's 0/1 specialization) and its input checks (on in the
    daemon) would refuse batch size 1; the daemon checks the batch (>= 1)
    itself, and the parity check runs every such graph at batch size 1.
    """
    options = {
        "aot_inductor.output_path": out_path,
        "aot_inductor.use_consts_asm_build": False,
        "aot_inductor.package_constants_in_so": True,
    }
    if batched:
        options["aot_inductor.check_lowerbound"] = False
    return options


def example_inputs(scan: Scan, sample: list[bytes] | None = None) -> list[Any]:
    """The dry run's (and parity check's) inputs: the requesting scan's own
    when the daemon sent them, else uniform in [0, 1)."""
    dtype = getattr(torch, scan.dtype)
    shapes = spec_leaves(scan.carry_spec) + spec_leaves(scan.inputs_spec)
    if sample is not None:
        return sample_inputs(sample, shapes, dtype)
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(s, dtype=dtype, generator=gen) for s in shapes]


def sample_inputs(sample: list[bytes], shapes: list[list[int]], dtype: Any) -> list[Any]:
    if len(sample) != len(shapes):
        raise JobError("COMPILE_FAILED", f"malformed job from the daemon: {len(sample)} "
                       f"sample leaves for {len(shapes)} tensors")
    out = []
    size = torch.empty((), dtype=dtype).element_size()
    for b, shape in zip(sample, shapes):
        if len(b) != math.prod(shape) * size:
            raise JobError("COMPILE_FAILED", "malformed job from the daemon: a sample leaf "
                           f"of {len(b)} bytes for shape {shape}")
        t = torch.frombuffer(bytearray(b), dtype=dtype) if b else torch.empty(0, dtype=dtype)
        out.append(t.reshape(shape))
    return out


def vjp_module(scan: Scan, n_in: int) -> Callable[..., Any]:
    """forward + VJP over the flat scan, traced with make_fx (first order)."""
    from torch.func import vjp

    def fn(*args: Any) -> tuple[Any, ...]:
        primals, cotangents = args[:n_in], args[n_in:]
        outs, pullback = vjp(lambda *p: scan.forward(*p), *primals)
        grads = pullback(tuple(cotangents))
        return tuple(outs) + tuple(grads)

    return fn


def vjp_module_autograd(scan: Scan, n_in: int, n_lifted: int = 0) -> Callable[..., Any]:
    """forward + VJP with torch.autograd.grad, for strategy "scan": torch.func.vjp
    cannot trace through the scan op (it refuses functorch transforms of the
    compiled function), but the scan op has an autograd formula (a reversed scan)
    that make_fx records. The body's captured tensors come last (n_lifted of
    them), so make_fx sees them as inputs, not as real tensors inside a fake
    trace."""

    def fn(*args: Any) -> tuple[Any, ...]:
        primals = [a.detach().requires_grad_(True) for a in args[:n_in]]
        cotangents = args[n_in : len(args) - n_lifted]
        lifted = list(args[len(args) - n_lifted :]) if n_lifted else None
        with torch.enable_grad():
            outs = scan.forward(*primals, lifted=lifted)
            pairs = [(o, g) for o, g in zip(outs, cotangents) if o.requires_grad]
            grads = torch.autograd.grad(
                [o for o, _ in pairs], primals, [g for _, g in pairs], allow_unused=True
            ) if pairs else [None] * n_in
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(primals, grads)]
        return tuple(o.detach() for o in outs) + tuple(grads)

    return fn


def cotangents(outs: tuple[Any, ...]) -> list[Any]:
    """The VJP graph's example cotangents (also the parity check's)."""
    gen = torch.Generator().manual_seed(1)
    return [torch.rand(o.shape, dtype=o.dtype, generator=gen) for o in outs]


@dataclass
class BatchDims:
    """The symbolic batch of a dynamic = batch graph: which dimension of each
    of its flat tensors is the batch size (-1 in these shapes)."""

    dim: Any  # torch.export.Dim
    inputs: list[list[int]]  # data inputs (cotangents included)
    results: list[list[int]]  # results, which are also its out buffers

    def spec(self, shapes: list[list[int]]) -> tuple[Any, ...]:
        return tuple({i: self.dim for i, d in enumerate(s) if d == BATCH} or None
                     for s in shapes)

    def of(self, shapes: list[list[int]]) -> Any:
        """torch.export's dynamic_shapes for a module taking *flat."""
        return (self.spec(shapes),)


def batch_dims(carry: Any, inputs: Any, y: Any, steps: int, kind: str,
               max_batch: int) -> BatchDims:
    carry_s, inputs_s = spec_leaves(carry), spec_leaves(inputs)
    stacked = [[steps] + s for s in spec_leaves(y)]
    ins, results = carry_s + inputs_s, carry_s + stacked
    if KINDS[kind]:
        ins, results = ins + results, results + ins
    dim = torch.export.Dim("B", min=1, max=max_batch)
    return BatchDims(dim, ins, results)


def capture(
    scan: Scan, args: list[Any], outs: tuple[Any, ...], kind: str, strict: bool,
    dyn: BatchDims | None = None,
) -> tuple[Any, tuple[Any, ...]]:
    """torch.export of the flat scan (or make_fx of its VJP, then export), as
    a graph that writes its results into buffers passed after its inputs."""
    module, example = capture_values(scan, args, outs, kind, strict, dyn)
    results = tuple(outs) + (tuple(args) if KINDS[kind] else ())
    bufs = tuple(torch.empty(r.shape, dtype=r.dtype) for r in results)
    shapes = dyn.of(dyn.inputs + dyn.results) if dyn else None
    try:
        ep = torch.export.export(OutModule(module, len(example)), example + bufs, strict=False,
                                 dynamic_shapes=shapes)
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return ep.module(), example + bufs


def capture_values(
    scan: Scan, args: list[Any], outs: tuple[Any, ...], kind: str, strict: bool,
    dyn: BatchDims | None = None,
) -> tuple[Any, tuple[Any, ...]]:
    """The graph that returns its results (torch.export / make_fx + export).

    With a symbolic batch, make_fx traces the VJP symbolically (so no size is
    baked into its views and expands) and lets the body's module-level
    tensors in as real constants."""
    if kind == "vjp_checkpoint":
        if not dyn:
            return capture_checkpointed(scan, args, outs)
        # torch 2.14's Inductor cannot lower the scan op over a symbolic size
        scan.notes.append("dynamic = batch: the checkpointed VJP needs the scan op, which "
                          "torch's Inductor cannot lower over a symbolic batch; compiled "
                          "the plain VJP (intermediates kept, not recomputed) instead")
        log(scan.notes[-1])
        kind = "vjp"
    forward_shapes = dyn.of(dyn.inputs[: len(args)]) if dyn else None
    vjp_shapes = dyn.of(dyn.inputs) if dyn else None
    trace = {"tracing_mode": "symbolic", "_allow_non_fake_inputs": True} if dyn else {}
    use_scan = scan.strategy != "unroll"  # the scan op's, or blocks of it
    if use_scan and dyn:
        # torch 2.14's Inductor fails on the scan op over a symbolic size
        # ("InductorError: KeyError: s39", forward and VJP alike): the unrolled
        # loop instead -- the same numbers, its compile time -- and the reply says so
        scan.notes.append(
            "dynamic = batch: torch's Inductor cannot lower the scan op over a symbolic "
            "batch; compiled the unrolled loop instead")
        log(scan.notes[-1])
        use_scan = False
    unrolled = replace(scan, strategy="unroll")
    try:
        if kind == "vjp":
            from torch.fx.experimental.proxy_tensor import make_fx

            cot = cotangents(outs)
            example = tuple(args) + tuple(cot)
            ep = None
            if use_scan:
                lifted = [t.detach() for _, t in captured_tensors(scan.body)]
                try:
                    # fake tensors throughout: with real ones, the scan op's
                    # backward meets the lifted tensors real inside its fake trace
                    gm = make_fx(vjp_module_autograd(scan, len(args), len(lifted)),
                                 **(trace or {"tracing_mode": "fake"}))(*args, *cot, *lifted)
                    ep = torch.export.export(Wrap(gm, lifted), example, strict=False,
                                             dynamic_shapes=vjp_shapes)
                except Exception as exc:  # noqa: BLE001 - the unrolled VJP below
                    scan.notes.append(
                        f"the scan op's VJP could not be captured ({type(exc).__name__}: "
                        f"{str(exc)[:120]}); compiled the unrolled VJP instead")
                    log(scan.notes[-1])
            if ep is None:
                gm = make_fx(vjp_module(unrolled, len(args)), **trace)(*args, *cot)
                ep = torch.export.export(Wrap(gm), example, strict=False,
                                         dynamic_shapes=vjp_shapes)
            scan.lowered = scan.strategy if use_scan and not scan.notes else "unroll"
        else:
            example = tuple(args)
            ep = torch.export.export(FlatModule(scan if use_scan else unrolled), example,
                                     strict=strict, dynamic_shapes=forward_shapes)
            scan.lowered = scan.strategy if use_scan else "unroll"
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    return ep.module(), example


def capture_checkpointed(scan: Scan, args: list[Any],
                         outs: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The checkpointed VJP (checkpoint.py): each step's carry saved, the step
    recomputed in the reverse loop; whatever the adapter's strategy, both
    loops are the scan op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    nc = scan.n_carry
    step, captured = scan.flat_step(clone=False)
    lifted = [t.detach() for t in captured]
    cot = cotangents(outs)
    example = tuple(args) + tuple(cot)
    try:
        module = checkpoint.checkpointed_vjp(
            step, nc, len(args) - nc, len(lifted), [*args[:nc], *(a[0] for a in args[nc:]), *lifted])
        gm = make_fx(module, tracing_mode="fake")(*args, *cot, *lifted)
        ep = torch.export.export(Wrap(gm, lifted), example, strict=False)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "capture") from exc
    scan.lowered = "scan"
    scan.notes.append("checkpointed: the forward loop keeps each step's carry, the reverse "
                      "loop recomputes the step before its VJP")
    return ep.module(), example


# AOTI's interface keeps the last error in a thread_local std::string, which
# every entry point touches: each thread that calls into an artifact registers
# its destructor (__cxa_thread_atexit), and glibc keeps the library mapped
# until that thread exits -- the daemon's threads never do.  The same text with
# a trivially destructible buffer registers nothing.
LAST_ERROR_DECL = "static thread_local std::string g_aoti_last_error;"
LAST_ERROR_BUFFER = """#include <cstdio>
struct TorchloopLastError {  // torchloop: no thread-exit destructor (unloadable)
  char text[1024];
  void clear() { text[0] = '\\0'; }
  TorchloopLastError& operator=(const char* s) {
    std::snprintf(text, sizeof text, "%s", s);
    return *this;
  }
  const char* c_str() const { return text; }
};
static thread_local TorchloopLastError g_aoti_last_error;"""


def unloadable_artifacts() -> None:
    """Builds every artifact so that the daemon's dlclose unmaps it (once per
    process); check_artifact refuses one that would stay mapped.

    - g++ gives the static locals of inline functions (AOTI's runtime has a
      few dozen: log guards, regex tables) STB_GNU_UNIQUE binding, and glibc
      never unloads a library that defines one: -fno-gnu-unique makes them
      ordinary weak symbols, private to each artifact (loaded RTLD_LOCAL).
    - the interface's last-error string: LAST_ERROR_BUFFER instead.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder
    from torch._inductor.codegen import cpp_wrapper_cpu

    orig = cpp_builder._get_optimization_cflags
    if getattr(orig, "torchloop_unloadable", False):
        return

    def cflags(cpp_compiler: str, min_optimize: bool = False) -> tuple[list[str], list[str]]:
        c, ld = orig(cpp_compiler, min_optimize)
        return ([*c, "fno-gnu-unique"] if cpp_builder._is_gcc(cpp_compiler) else c), ld

    interface = os.path.join(os.path.dirname(cpp_wrapper_cpu.__file__), "aoti_runtime",
                             "interface.cpp")
    wrapper = cpp_wrapper_cpu.CppWrapperCpu
    orig_header = wrapper._write_aoti_interface_header

    def header(self: Any) -> None:
        if not inductor_config.aot_inductor.dynamic_linkage:
            return orig_header(self)
        with open(interface) as f:
            text = f.read()
        if LAST_ERROR_DECL not in text:  # another torch: its artifacts are refused
            return orig_header(self)
        self.header.splice_aot(text.replace(LAST_ERROR_DECL, LAST_ERROR_BUFFER))
        self.header.splice_aot("\n")
        return None

    cflags.torchloop_unloadable = True  # type: ignore[attr-defined]
    cpp_builder._get_optimization_cflags = cflags
    wrapper._write_aoti_interface_header = header


def build_artifact(module: Any, example: tuple[Any, ...], so_path: str,
                   batched: bool = False, placer: StackIntoOutputs | None = None) -> str:
    """AOT-compiles module into so_path (with placer as the post-grad pass
    when given); returns the .so's path."""
    unloadable_artifacts()
    options = aoti_options(so_path, batched)
    if placer is not None:
        options["post_grad_custom_post_pass"] = placer
    try:
        so = torch._inductor.aot_compile(module, example, options=options)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "inductor") from exc
    built = so if isinstance(so, str) else so_path
    if clear_exec_stack(built):
        log(f"{built}: cleared the executable-stack flag ld set")
    return built


def build_placed(build: Callable[[str, StackIntoOutputs | None], str],
                 notes: list[str]) -> str:
    """build(name, placer) with StackIntoOutputs; placing the stacked results
    into the buffers is an optimisation, so if a graph it rewrote fails to
    build or to match eager, builds it again as Inductor would and says so in
    notes.  A failure of the machine (transient) is not retried."""
    placer = StackIntoOutputs()
    try:
        return build("graph.so", placer)
    except JobError as exc:
        if not placer.rewritten or exc.transient:
            raise
        notes.append(f"placing the stacked results into the result buffers failed ({exc.code}: "
                     f"{exc.message[:160]}); compiled with them copied in instead")
        log(notes[-1])
    return build("graph-copied.so", None)


# The parity check's tolerance: norm-wise, max |compiled - eager| / max |eager|
# per output (the test suites' float64 bound; float32 rounds 2^29 times coarser).
PARITY_RTOL = {"float64": 1e-6, "float32": 1e-3}


def parity_reference(scan: Scan, args: list[Any], outs: tuple[Any, ...],
                     kind: str) -> list[Any]:
    """What the artifact must compute, eagerly and without the tracer: the dry
    run's outputs, and for a VJP graph torch.func.vjp of the unrolled loop."""
    if not KINDS[kind]:
        return list(outs)
    dry = replace(scan, strategy="unroll", tracing=False)
    return list(vjp_module(dry, len(args))(*args, *cotangents(outs)))


def parity_mismatch(got: Any, want: Any, rtol: float,
                    skip_nonfinite: bool) -> tuple[float, int, float] | None:
    """(max |got - want|, its flat index, max |want|) when got disagrees with
    want beyond rtol (norm-wise), else None.  Elements that are equal (the
    same infinity included) or NaN on both sides agree; with skip_nonfinite
    (random inputs, which may overflow where the user's never do) an element
    whose eager value is not finite is not checked at all."""
    g = got.detach().to(torch.float64).reshape(-1)
    w = want.detach().to(torch.float64).reshape(-1)
    if w.numel() == 0:
        return None
    finite = torch.isfinite(w)
    agree = (g == w) | (torch.isnan(g) & torch.isnan(w))
    if skip_nonfinite:
        agree |= ~finite
    inf = float("inf")
    diff = torch.where(agree, torch.zeros_like(g), (g - w).abs().nan_to_num(nan=inf, posinf=inf))
    scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
    err = float(diff.max())
    if err <= rtol * max(scale, 1e-30):
        return None
    return err, int(diff.argmax()), scale


def parity_check(so_path: str, cases: list[tuple[int, tuple[Any, ...], list[Any]]],
                 dtype: str, n_carry: int, n_y: int, random: bool) -> None:
    """Runs the new artifact on each case's inputs (its results land in fresh
    buffers) and refuses it with MISCOMPILE if any output disagrees with the
    eager reference beyond PARITY_RTOL (parity_mismatch). A case is (batch
    size or 0, the graph's data inputs, the eager results); a symbolic-batch
    graph is checked at its probe size and at batch size 1.  random: the
    inputs are random ones, not the requesting scan's."""
    runner = torch._C._aoti.AOTIModelContainerRunnerCpu(so_path, 1)
    artifacts_loaded[0] += 1
    on = "random inputs (uniform in [0, 1))" if random else "the request's own inputs"
    for batch, inputs, want in cases:
        bufs = [torch.full(w.shape, float("nan"), dtype=w.dtype) for w in want]
        got = runner.run([t.clone() for t in inputs] + bufs)
        where = f" at batch size {batch}" if batch else ""
        names = (["carry"] * n_carry + ["outputs"] * n_y + ["grad_carry"] * n_carry +
                 ["grad_inputs"] * (len(want) - 2 * n_carry - n_y))
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape:
                raise JobError("MISCOMPILE", f"output {i} ({names[i]}) has shape "
                               f"{list(g.shape)}{where}, the eager scan {list(w.shape)}")
            bad = parity_mismatch(g, w, PARITY_RTOL[dtype], random)
            if bad is None:
                continue
            err, at, scale = bad
            raise JobError(
                "MISCOMPILE",
                f"the compiled graph disagrees with the eager scan on output {i} "
                f"({names[i]}){where}, run on {on}: max |compiled - eager| = {err:.3g} at "
                f"flat index {at} (compiled {float(g.reshape(-1)[at]):.17g}, eager "
                f"{float(w.reshape(-1)[at]):.17g}) against max |eager| = {scale:.3g}; "
                f"tolerance {PARITY_RTOL[dtype]:g} relative. Nothing was cached.",
                names[i])
    del runner


def check_body(job: Job) -> dict[str, Any]:
    """Register-time check: the source imports and defines a callable entry,
    or the captured graph loads (every field checked, run over fake tensors)."""
    load_body(job)
    return {"ok": True}


def dry_run(scan: Scan, kind: str,
            sample: list[bytes] | None = None) -> tuple[list[Any], tuple[Any, ...], list[Any]]:
    """Eager scan at the scan's specs on the request's inputs (sample) or
    random ones: (inputs, outputs, the parity check's case inputs and
    reference). Body exceptions and carry changes get a step number and a
    leaf path before the tracer's messages can hide them."""
    args = example_inputs(scan, sample)
    with torch.no_grad():
        dry = replace(scan, strategy="unroll")
        outs = dry.forward(*args)
    scan.y_spec = dry.y_spec
    data = tuple(args) + (tuple(cotangents(outs)) if KINDS[kind] else ())
    return args, outs, [data, parity_reference(scan, args, outs, kind)]


def compile_job(job: Job) -> dict[str, Any]:
    started = time.monotonic()
    carry, inputs, steps = job.carry, job.inputs, job.steps
    batched = spec_has_batch(carry) or spec_has_batch(inputs)
    max_batch = job.max_batch
    b1, b2 = probe_batches(carry, inputs, steps) if batched else (0, 0)
    body = load_body(job)

    def at(batch: int) -> Scan:
        return Scan(body=body, carry_spec=spec_bind(carry, batch),
                    inputs_spec=spec_bind(inputs, batch), steps=steps, dtype=job.dtype,
                    strategy=job.strategy)

    scan = at(b1)
    if scan.dtype not in ("float32", "float64"):
        raise JobError("BAD_DTYPE", f"dtype {scan.dtype} is not float32 or float64")
    torch.manual_seed(0)
    phases: dict[str, float] = {}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = now - mark
        mark = now

    phase("setup")
    kind = job.kind

    def traced_at(batch: int, fn: Callable[[], Any]) -> Any:
        """A body error of a symbolic-batch compile says which batch size it ran at."""
        try:
            return fn()
        except JobError as exc:
            if batched:
                exc.message += f" (dynamic = batch: the body ran at batch size {batch})"
            raise

    sample = None if batched else job.sample
    args, outs, case = traced_at(b1, lambda: dry_run(scan, kind, sample))
    n_in = len(args)
    cases = [(b1, *case)]
    y_spec, dyn = scan.y_spec, None
    if batched:
        # the outputs' batch dimensions, from a second size; then batch size 1
        # (which torch would otherwise specialize) for the parity check
        other = at(b2)
        traced_at(b2, lambda: dry_run(other, "forward"))
        y_spec = batch_y_spec(scan.y_spec, other.y_spec, b1, b2)
        cases.append((1, *traced_at(1, lambda: dry_run(at(1), kind))[2]))
        dyn = batch_dims(carry, inputs, y_spec, steps, kind, max(max_batch, b1, b2))
    phase("eager")
    scan.tracing = True
    module, example = capture(scan, args, outs, kind, job.strict, dyn)
    phase("export")
    out_path = job.output
    # AOTI writes its intermediates (wrapper/kernel sources, objects, the
    # extern-node json) beside output_path: give it a directory of its own,
    # named after the output so the daemon can remove it whatever happens here.
    job_dir = out_path + ".d"
    os.makedirs(job_dir, mode=0o700)

    def build(name: str, placer: StackIntoOutputs | None) -> str:
        so = build_artifact(module, example, os.path.join(job_dir, name), batched, placer)
        check_artifact(so, job_dir)
        phase("inductor")
        parity_check(so, cases, scan.dtype, scan.n_carry, len(outs) - scan.n_carry,
                     sample is None)
        phase("parity")
        return so

    try:
        os.replace(build_placed(build, scan.notes), out_path)
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
    return {
        "so": out_path,
        "y": strip_dtype(y_spec),
        "n_inputs": len(example),
        "n_outputs": len(outs) + (n_in if KINDS[kind] else 0),
        "torch": torch.__version__,
        "compile_seconds": time.monotonic() - started,
        # where it went: import and set-up, the eager dry run (and the parity
        # reference), torch.export, AOTInductor (lowering + C++ compile), the
        # parity run
        "phases": phases,
        # how the loop was lowered, and why when not as the strategy asked
        "lowered": scan.lowered,
        "note": "; ".join(scan.notes),
        # the step's size in ATen calls: what the daemon's upgrade plan
        # estimates an unrolled compile from
        "step_ops": step_ops(module, scan.lowered, steps),
    }


def step_ops(module: torch.nn.Module, lowered: str, steps: int) -> int:
    """ATen calls of one step of the captured loop."""
    k = block_size(lowered)
    per = k + steps % k if k else 1 if lowered == "scan" else steps
    return graph_ops(module) // max(per, 1)


def hold_lifted(module: torch.nn.Module, tensors: list[Any]) -> list[str]:
    """Registers tensors as module's buffers (lifted0, lifted1, ...): torch.export
    traces them like parameters and AOTI keeps them as the graph's constants.
    Returns their names, in order."""
    names = [f"lifted{i}" for i in range(len(tensors))]
    for n, t in zip(names, tensors):
        module.register_buffer(n, t.detach(), persistent=True)
    return names


class FlatModule(torch.nn.Module):
    """The flat scan as a module for torch.export."""

    def __init__(self, scan: Scan) -> None:
        super().__init__()
        self.scan = scan
        # the scan op takes the body's captured tensors as inputs
        self.lifted = hold_lifted(self, [t for _, t in captured_tensors(scan.body)]
                                  if scan.strategy != "unroll" else [])

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lifted = [getattr(self, n) for n in self.lifted] if self.lifted else None
        return self.scan.forward(*flat, lifted=lifted)


class Wrap(torch.nn.Module):
    """A traced function (make_fx's graph) as a module for torch.export;
    lifted: tensors passed after the inputs, held as buffers (constants of
    the graph)."""

    def __init__(self, fn: Callable[..., Any], lifted: list[Any] | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.lifted = hold_lifted(self, lifted or [])

    def forward(self, *flat: torch.Tensor) -> Any:
        return self.fn(*flat, *(getattr(self, n) for n in self.lifted))


class OutModule(torch.nn.Module):
    """The daemon's calling convention: inputs, then one buffer per result;
    the results are written into the buffers (the daemon passes the client's
    shared memory, or memory of its own) and the buffers are returned."""

    def __init__(self, fn: Callable[..., Any], n_in: int) -> None:
        super().__init__()
        self.fn = fn
        self.n_in = n_in

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = self.fn(*flat[: self.n_in])
        bufs = flat[self.n_in :]
        for buf, r in zip(bufs, results):
            buf.copy_(r)
        return tuple(bufs)


def hello() -> dict[str, Any]:
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return {
        "protocol": PROTOCOL,
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", ""),
        "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
        "python": sys.version.split()[0],
        "torch_ok": version >= MIN_TORCH,
        "torch_lib": os.path.join(os.path.dirname(torch.__file__), "lib"),
        "isa": target_isa(),
    }


def target_isa() -> str:
    """What Inductor generates code for here: its vector ISA and -march.

    Both follow the environment the daemon gives the worker
    (ATEN_CPU_CAPABILITY, TORCHINDUCTOR_CPP_MARCH); the daemon puts this
    string in every cache key.
    """
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return f"vec={isa if isa else 'none'};march={config.cpp.march or 'native'}"


# Each parity check loads an artifact (unloaded after it: unloadable_artifacts);
# after this many, the reply asks the daemon to replace this worker (between
# jobs), which bounds whatever else a long-lived worker accumulates.
RECYCLE_AFTER = max(1, int(os.environ.get("TORCHLOOP_WORKER_RECYCLE", "32") or 32))
artifacts_loaded = [0]


def handle(req: dict[str, Any]) -> dict[str, Any]:
    reply = handle_op(req)
    if artifacts_loaded[0] >= RECYCLE_AFTER:
        reply["recycle"] = True
    return reply


def handle_op(req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    rid = req.get("id")
    try:
        if op == "hello":
            return {"id": rid, "result": hello()}
        if op == "compile":
            return {"id": rid, "result": compile_job(Job.parse(req))}
        if op == "check":
            return {"id": rid, "result": check_body(Job.parse(req))}
        raise JobError("UNKNOWN_OP", f"worker has no op {op!r}")
    except JobError as exc:
        return exc.reply(rid)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
        log(traceback.format_exc())
        return classify(exc, "inductor").reply(rid)


PR_SET_PDEATHSIG = 1


def die_with_daemon() -> None:
    """SIGKILL this worker when the daemon's spawning thread dies.

    The daemon passes its pid in TORCHLOOPD_PID; if it is already gone
    (we were reparented before prctl took effect), exit at once.
    """
    parent = os.environ.get("TORCHLOOPD_PID")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if parent and os.getppid() != int(parent):
        log("the daemon is gone; exiting")
        os._exit(3)


def main() -> int:
    die_with_daemon()
    # The parity check runs artifacts as the daemon does: with the generated
    # code's input checks on (read once per artifact, at its first run).
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    # Replies go to the real stdout; anything torch prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer

    log(f"ready (torch {torch.__version__})")
    while True:
        try:
            req = read_frame(stdin)
        except (EOFError, ValueError) as exc:
            log(f"bad frame from the daemon: {exc}")
            return 2
        if req is None:
            return 0
        write_frame(out, handle(req))


if __name__ == "__main__":
    sys.exit(main())

"""A job from the daemon (Job) and the body it names: an adapter's source,
imported under a name unique to its content, or a captured step graph
(graph_loader.py), loaded as data."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .blocked import block_size
from .errors import JobError
from .graph_loader import GraphBody, GraphError, load
from .specs import Spec, Tree

# A body: step(carry, x) -> (new carry, y); what it returns is checked.
Body = Callable[[Tree, Tree], object]

# Job kinds -> whether the graph is a VJP (takes the cotangents after the
# inputs, returns the gradients after the outputs); the daemon's spec kinds
# (daemon/graph/kinds.c, spec_kinds) name them.  The saved kinds (saved.py)
# lay their inputs and results out their own way.
KINDS = {"forward": False, "vjp": True, "vjp_checkpoint": True, "forward_save": False,
         "backward_saved": False}


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
    # a saved kind's gradient mask: '1' per flat input (carry, then inputs)
    # whose gradient the graph computes; "": every one (saved.py)
    wrt: str = ""

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
                carry=spec_of(req.get("carry")),
                inputs=spec_of(req.get("inputs")),
                strict=bool(req.get("strict", False)),
                sample=parse_sample(req.get("sample")),
                wrt=str(req.get("wrt") or ""),
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


def spec_of(node: object) -> Spec:
    if node is not None and not isinstance(node, dict):
        raise TypeError(f"a spec is a map or nil, not {type(node).__name__}")
    return node


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
            body = load(text)
        except GraphError as exc:
            raise JobError(exc.code, exc.message, exc.path) from None
        if len(GRAPHS) >= 64:
            GRAPHS.pop(next(iter(GRAPHS)))
        GRAPHS[digest] = body
    return body


def load_body(job: Job) -> Body:
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




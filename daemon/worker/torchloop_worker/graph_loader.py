"""Loading a captured step graph ("torchloop.graph" v1) from untrusted text.

The Python package captures a body's step in the solver's process and
ships it as JSON (client/python/torchloop/_graph.py writes it;
docs/protocol.md, "Captured graphs", has the format).  Any user allowed on
the socket may register one, so nothing here executes what the text says:
it is parsed with `json` (no pickle, no `torch.load`, no `torch.export.load`,
which falls back to unpickling), every field is checked, every op is looked
up by name among core ATen operators (minus the few that read or alias raw
memory), every reference must point backwards, constants' declared sizes
must equal their bytes, and the graph is run over fake tensors at its
declared shapes before it is handed to the compile path.  Anything else is
GraphError, which the worker answers with BAD_GRAPH.

The loaded body is `GraphBody(carry, x)` with carry = (the user's carry,
tuple of the live captured tensors): the graph passes the captured tensors
through unchanged, so the scan returns them and gradients reach them.
"""

from __future__ import annotations

import base64
import json
import math
import operator
import re
from typing import Any, Callable, Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import GraphError  # raised here; defined there (hello imports no torch)

FORMAT, VERSION = "torchloop.graph", 1
MAX_TEXT = 1 << 20  # PROTO_MAX_SOURCE: the daemon refuses larger ones first
MAX_NODES = 50_000
MAX_INPUTS = 4096
MAX_RANK = 8
MAX_TREE_DEPTH = 32
MAX_ELEMENTS = 1 << 24  # any tensor of the graph, intermediates included

DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format,
                  "preserve_format": torch.preserve_format,
                  "channels_last": torch.channels_last}
FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# core ATen ops that hand out uninitialised memory or reinterpret storage:
# Inductor emits them without bounds checks
DENIED = re.compile(r"^(empty|new_empty|as_strided|_unsafe|resize|set_|_local_scalar_dense)")
OP_NAME = re.compile(r"^aten\.([a-z_][a-z0-9_]{0,63})\.([A-Za-z_][A-Za-z0-9_]{0,63})$")

Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]


def _need(cond: bool, message: str, path: str) -> None:
    if not cond:
        raise GraphError(message, path)


def _int(v: Json, lo: int, hi: int, path: str) -> int:
    _need(type(v) is int and lo <= v <= hi, f"{path} must be an integer in [{lo}, {hi}]", path)
    return v  # type: ignore[return-value]


def _tree(node: Json, path: str, depth: int = 0) -> int:
    """Checks a tree definition; returns its number of tensor leaves."""
    _need(depth <= MAX_TREE_DEPTH, f"{path} is nested deeper than {MAX_TREE_DEPTH}", path)
    if node is None or node == "T":
        return int(node == "T")
    _need(isinstance(node, list) and len(node) in (2, 3), f"{path} is not a tree node", path)
    assert isinstance(node, list)
    if node[0] == "dict" and len(node) == 3:
        keys, kids = node[1], node[2]
        _need(isinstance(keys, list) and isinstance(kids, list) and len(keys) == len(kids)
              and all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys),
              f"{path}: a dict node needs distinct string keys, one per child", path)
    else:
        _need(node[0] in ("tuple", "list") and len(node) == 2 and isinstance(node[1], list),
              f"{path} is not a tree node", path)
        kids = node[1]
    assert isinstance(kids, list)  # checked by _need above
    return sum(_tree(k, f"{path}[{i}]", depth + 1) for i, k in enumerate(kids))


def _meta(m: Json, path: str) -> tuple[torch.dtype, list[int]]:
    _need(isinstance(m, dict), f"{path} must be a map with dtype and shape", path)
    assert isinstance(m, dict)
    dtype = DTYPES.get(m.get("dtype"))  # type: ignore[arg-type]
    _need(dtype is not None, f"{path}.dtype must be one of {sorted(DTYPES)}", path)
    shape = m.get("shape")
    _need(isinstance(shape, list) and len(shape) <= MAX_RANK,
          f"{path}.shape must be a list of at most {MAX_RANK} sizes", path)
    dims = [_int(d, 0, MAX_ELEMENTS, f"{path}.shape[{i}]") for i, d in enumerate(shape)]  # type: ignore[arg-type]
    _need(math.prod(dims) <= MAX_ELEMENTS, f"{path} has more than {MAX_ELEMENTS} elements", path)
    assert dtype is not None
    return dtype, dims


def _constant(m: Json, path: str) -> torch.Tensor:
    dtype, dims = _meta(m, path)
    assert isinstance(m, dict)
    data = m.get("data")
    _need(isinstance(data, str), f"{path}.data must be base64 text", path)
    try:
        raw = base64.b64decode(data, validate=True)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GraphError(f"{path}.data is not base64: {exc}", path) from None
    size = math.prod(dims) * torch.empty((), dtype=dtype).element_size()
    _need(len(raw) == size, f"{path} declares {dims} {dtype} ({size} bytes) but carries "
          f"{len(raw)} bytes", path)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(dims).clone()


def _op(name: Json, path: str) -> Callable[..., Any]:
    _need(isinstance(name, str), f"{path}.op must be a string", path)
    if name == "getitem":
        return operator.getitem
    m = OP_NAME.match(name)  # type: ignore[arg-type]
    _need(m is not None, f"{path}.op {name!r} is not an ATen operator (aten.<name>.<overload>)",
          path)
    assert m is not None
    _need(not DENIED.match(m.group(1)), f"{path}.op {name} is not allowed in a captured "
          "graph (it hands out uninitialised or reinterpreted memory)", path)
    try:
        op = getattr(getattr(torch.ops.aten, m.group(1)), m.group(2))
    except (AttributeError, RuntimeError):
        raise GraphError(f"{path}.op {name} is not an ATen operator of torch "
                         f"{torch.__version__}", path) from None
    _need(isinstance(op, torch._ops.OpOverload) and torch.Tag.core in op.tags,
          f"{path}.op {name} is not a core ATen operator", path)
    return op


class _Reader:
    """Turns JSON argument values into FX arguments, refs into earlier nodes."""

    def __init__(self, inputs: list[torch.fx.Node], constants: list[torch.fx.Node]) -> None:
        self.inputs, self.constants = inputs, constants
        self.nodes: list[torch.fx.Node] = []

    def value(self, v: Json, path: str, depth: int = 0) -> Any:
        _need(depth <= MAX_TREE_DEPTH, f"{path} is nested too deeply", path)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        _need(isinstance(v, dict) and len(v) == 1, f"{path}: an object must have one key", path)
        assert isinstance(v, dict)
        ((key, arg),) = v.items()
        pools = {"n": self.nodes, "i": self.inputs, "k": self.constants}
        if key in pools:
            pool = pools[key]
            _need(bool(pool), f"{path} refers to a {key!r} where there is none", path)
            return pool[_int(arg, 0, len(pool) - 1, f"{path}.{key}")]
        tables: dict[str, dict[str, Any]] = {
            "f": FLOATS, "dtype": DTYPES, "layout": LAYOUTS, "memory_format": MEMORY_FORMATS,
            "device": {"cpu": torch.device("cpu")}}
        _need(key in tables and isinstance(arg, str) and arg in tables[key],
              f"{path}: {key!r}: {arg!r} is not a value a graph may hold", path)
        return tables[key][arg]  # type: ignore[index]


class GraphBody:
    """A loaded graph as a scan body: body((carry, captured), x) -> ((new, captured), y)."""

    def __init__(self, gm: torch.fx.GraphModule, doc: dict[str, Any],
                 metas: list[tuple[torch.dtype, list[int]]], constants: list[torch.Tensor]) -> None:
        self.gm, self.doc, self.metas, self.constants = gm, doc, metas, constants
        self.n_carry, self.n_x = doc["n_carry"], doc["n_x"]
        self.n_params = doc["n_params"]

    # the worker's lifting of a body's tensors into the scan op (compile_worker.py)
    def lifted_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"k{i}", t) for i, t in enumerate(self.constants)]

    def with_tensors(self, values: dict[str, Any]) -> GraphBody:
        consts = [values.get(f"k{i}", t) for i, t in enumerate(self.constants)]
        return GraphBody(self.gm, self.doc, self.metas, consts)

    def __call__(self, carry: Any, x: Any) -> tuple[Any, Any]:
        if not isinstance(carry, tuple) or len(carry) != 2 or not isinstance(carry[1], tuple):
            raise GraphError("a captured graph's carry is (carry, tuple of captured tensors)",
                             "carry", "SPEC_MISMATCH")
        flat = leaves(carry[0]) + leaves(x) + list(carry[1])
        if len(flat) != len(self.metas):
            raise GraphError(f"the graph takes {len(self.metas)} tensors; the request has "
                             f"{len(flat)} (carry, inputs and captured tensors)", "carry",
                             "SPEC_MISMATCH")
        for i, (t, (dtype, dims)) in enumerate(zip(flat, self.metas)):
            if t.dtype != dtype or list(t.shape) != dims:
                raise GraphError(f"graph input {i} was captured as {dims} {dtype}; the request "
                                 f"has {list(t.shape)} {t.dtype}", "carry", "SPEC_MISMATCH")
        outs = self.gm(*flat, *self.constants)
        pos = [0]
        new_carry, y = build(self.doc["out"], list(outs), pos)
        return (new_carry, tuple(carry[1])), y


def leaves(tree: Any) -> list[Any]:
    if tree is None:
        return []
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in leaves(v)]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in leaves(v)]
    return [tree]


def build(tdef: Json, flat: list[Any], pos: list[int]) -> Any:
    if tdef is None:
        return None
    if tdef == "T":
        pos[0] += 1
        return flat[pos[0] - 1]
    assert isinstance(tdef, list)
    if tdef[0] == "dict":
        return {k: build(c, flat, pos) for k, c in zip(tdef[1], tdef[2])}  # type: ignore[arg-type]
    kids = [build(c, flat, pos) for c in tdef[1]]  # type: ignore[union-attr]
    return tuple(kids) if tdef[0] == "tuple" else kids


def parse(text: str) -> dict[str, Any]:
    _need(len(text) <= MAX_TEXT, f"the graph is over {MAX_TEXT} bytes", "graph")
    try:
        doc = json.loads(text, parse_constant=lambda c: _need(False, f"{c} is not JSON", "graph"))
    except (ValueError, RecursionError) as exc:
        raise GraphError(f"the graph is not JSON: {exc}") from None
    _need(isinstance(doc, dict) and doc.get("format") == FORMAT,
          f"the graph is not a {FORMAT} document", "graph")
    _need(doc.get("version") == VERSION, f"graph version {doc.get('version')!r} is not "
          f"{VERSION}", "graph.version")
    for key, kind in (("inputs", list), ("constants", list), ("nodes", list), ("outputs", list)):
        _need(isinstance(doc.get(key), kind), f"graph.{key} must be a list", f"graph.{key}")
    _need(len(doc["nodes"]) <= MAX_NODES, f"the graph has over {MAX_NODES} nodes", "graph.nodes")
    _need(len(doc["inputs"]) <= MAX_INPUTS, f"the graph has over {MAX_INPUTS} inputs",
          "graph.inputs")
    n = [_int(doc.get(k), 0, MAX_INPUTS, f"graph.{k}") for k in ("n_carry", "n_x", "n_params")]
    _need(sum(n) == len(doc["inputs"]), "n_carry + n_x + n_params must count graph.inputs",
          "graph.inputs")
    _need(n[1] >= 1, "the graph has no input row (n_x = 0)", "graph.n_x")
    _need(_tree(doc.get("carry"), "graph.carry") == n[0], "graph.carry's leaves are not n_carry",
          "graph.carry")
    _need(_tree(doc.get("x"), "graph.x") == n[1], "graph.x's leaves are not n_x", "graph.x")
    out = doc.get("out")
    _need(isinstance(out, list) and out[:1] == ["tuple"] and len(out) == 2
          and isinstance(out[1], list) and len(out[1]) == 2,
          "graph.out must be the tree of (new_carry, y)", "graph.out")
    _need(_tree(out, "graph.out") == len(doc["outputs"]), "graph.out's leaves are not the "
          "graph's outputs", "graph.out")
    _need(_tree(out[1][0], "graph.out") == n[0], "the new carry has another number of "
          "tensors than the carry", "graph.out")
    return doc


def load(text: str) -> GraphBody:
    """A GraphBody for the text, or GraphError; nothing in the text is executed."""
    doc = parse(text)
    metas = [_meta(m, f"graph.inputs[{i}]") for i, m in enumerate(doc["inputs"])]
    consts = [_constant(m, f"graph.constants[{i}]") for i, m in enumerate(doc["constants"])]
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"in{i}") for i in range(len(metas))]
    reader = _Reader(inputs, [graph.placeholder(f"k{i}") for i in range(len(consts))])
    for i, node in enumerate(doc["nodes"]):
        path = f"graph.nodes[{i}]"
        _need(isinstance(node, dict) and isinstance(node.get("args"), list)
              and isinstance(node.get("kwargs", {}), dict), f"{path} needs op, args, kwargs", path)
        op = _op(node.get("op"), path)
        args = reader.value(node["args"], f"{path}.args")
        kwargs = {str(k): reader.value(v, f"{path}.kwargs.{k}")
                  for k, v in node.get("kwargs", {}).items()}
        reader.nodes.append(graph.call_function(op, tuple(args), kwargs))
    outs = reader.value(doc["outputs"], "graph.outputs")
    _need(all(isinstance(o, torch.fx.Node) for o in outs), "graph outputs must be tensors",
          "graph.outputs")
    graph.output(tuple(outs))
    try:
        graph.lint()
    except RuntimeError as exc:
        raise GraphError(f"the graph is malformed: {exc}") from None
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    check_fake(gm, metas, consts)
    return GraphBody(gm, doc, metas, consts)


def check_fake(gm: torch.fx.GraphModule, metas: list[tuple[torch.dtype, list[int]]],
               consts: list[torch.Tensor]) -> None:
    """Runs the graph over fake tensors: schemas, shapes and sizes hold."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(dims, dtype=dtype) for dtype, dims in metas]
    args += [mode.from_tensor(t) for t in consts]

    class Checked(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            try:
                out = super().run_node(n)
            except GraphError:
                raise
            except Exception as exc:  # the op refused its arguments
                raise GraphError(f"{n.target} refused its arguments: {exc}",
                                 f"graph.nodes ({n.name})") from None
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() > MAX_ELEMENTS:
                    raise GraphError(f"{n.target} makes a tensor of {t.numel()} elements "
                                     f"(at most {MAX_ELEMENTS})", f"graph.nodes ({n.name})")
            return out

    with mode:
        outs = Checked(gm).run(*args)
    _need(all(isinstance(o, torch.Tensor) for o in outs), "graph outputs must be tensors",
          "graph.outputs")

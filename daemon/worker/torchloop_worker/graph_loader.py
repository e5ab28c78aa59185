"""Loading a captured step graph ("torchloop.graph" v1) from untrusted text.

The Python package captures a body's step in the solver's process and
ships it as JSON (client/python/torchloop/_graph.py writes it;
docs/protocol.md, "Captured graphs", has the format).  Any user allowed on
the socket may register one, so nothing here executes what the text says:
it is parsed with `json` (no pickle, no `torch.load`, no `torch.export.load`,
which falls back to unpickling; a key given twice is refused), every field
is checked, every node is bound to the schema of an allow-listed op
(graph_schema.py) and the FX graph is built from those bound values only:
torch.fx turns it into Python source that it exec's, so no key or string
of the text may reach it.  Every reference must point backwards,
constants' declared sizes must equal their bytes, tree keys are of a safe
charset, the generated code is checked line by line, and the graph is run
over fake tensors at its declared shapes (per-tensor and total element
bounds, no integral division) before it is handed to the compile path.
Anything else is GraphError, which the worker answers with BAD_GRAPH.

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
from typing import Any, Union

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .errors import GraphError  # raised here; defined there (hello imports no torch)
from .graph_schema import DTYPES, INT_DIVISION, PRODUCED_BY, STRINGS, bind, resolve

FORMAT, VERSION = "torchloop.graph", 1
MAX_TEXT = 1 << 20  # PROTO_MAX_SOURCE: the daemon refuses larger ones first
MAX_NODES = 50_000
MAX_INPUTS = 4096
MAX_RANK = 8
MAX_TREE_DEPTH = 32
MAX_ELEMENTS = 1 << 24  # any tensor of the graph, intermediates included
# inputs + constants + every tensor a node allocates (views excluded): what
# the fake run lets a graph make the worker hold, 512 MiB of float64
MAX_TOTAL_ELEMENTS = 1 << 26
TREE_KEY = re.compile(r"[A-Za-z0-9_.:+\-]{0,64}")  # a dict key of graph.carry/x/out

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
        _need(all(TREE_KEY.fullmatch(str(k)) for k in keys),  # type: ignore[union-attr]
              f"{path}: a dict key must be at most "
              "64 of A-Z a-z 0-9 _ . : + -", path)
    else:
        _need(node[0] in ("tuple", "list") and len(node) == 2 and isinstance(node[1], list),
              f"{path} is not a tree node", path)
        kids = node[1]
    assert isinstance(kids, list)  # checked by _need above
    return sum(_tree(k, f"{path}[{i}]", depth + 1) for i, k in enumerate(kids))


def _meta(m: Json, path: str) -> tuple[torch.dtype, list[int]]:
    _need(isinstance(m, dict), f"{path} must be a map with dtype and shape", path)
    assert isinstance(m, dict)
    name = m.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
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


def _check_producers(made: torch.fx.Node, path: str) -> None:
    """PRODUCED_BY: an argument that must come from a given op's output."""
    op: Any = made.target
    names = [a.name for a in op._schema.arguments]
    for (packet, arg), (producer, index) in PRODUCED_BY.items():
        if op.__name__.split(".")[0] != packet:
            continue
        at = names.index(arg)
        v = made.kwargs.get(arg, made.args[at] if at < len(made.args) else None)
        ok = bool(isinstance(v, torch.fx.Node) and v.target is operator.getitem
              and v.args[1] == index and isinstance(v.args[0], torch.fx.Node)
              and getattr(v.args[0].target, "__name__", "").split(".")[0] == producer)
        _need(ok, f"{path}: {packet}'s {arg} must be output {index} of a {producer} node",
              path)


class _Reader:
    """Resolves tensor references ({"n"|"i"|"k": index}) into earlier nodes."""

    def __init__(self, graph: torch.fx.Graph, inputs: list[torch.fx.Node],
                 constants: list[torch.fx.Node]) -> None:
        self.graph, self.inputs, self.constants = graph, inputs, constants
        self.nodes: list[torch.fx.Node] = []

    def ref(self, key: str, index: Json, path: str) -> torch.fx.Node:
        pool = {"n": self.nodes, "i": self.inputs, "k": self.constants}[key]
        _need(bool(pool), f"{path} refers to a {key!r} where there is none", path)
        return pool[_int(index, 0, len(pool) - 1, f"{path}.{key}")]

    def node(self, node: Json, path: str) -> torch.fx.Node:
        """One node, bound to its op's schema, appended to the graph."""
        _need(isinstance(node, dict) and set(node) <= {"op", "args", "kwargs"},
              f"{path} needs op, args, kwargs (and nothing else)", path)
        assert isinstance(node, dict)
        graph = self.graph
        if node.get("op") == "getitem":
            return self._getitem(graph, node, path)
        op = resolve(node.get("op"), path)
        args, kwargs = bind(op, node.get("args"), node.get("kwargs", {}), self.ref, path)
        made = graph.call_function(op, args, kwargs)
        _check_producers(made, path)
        return made

    def _getitem(self, graph: torch.fx.Graph, node: dict[str, Json], path: str) -> torch.fx.Node:
        args = node.get("args")
        _need(isinstance(args, list) and len(args) == 2 and isinstance(args[0], dict)
              and list(args[0]) == ["n"] and not node.get("kwargs"),
              f"{path}: getitem takes [{{\"n\": node}}, index] and no kwargs", path)
        assert isinstance(args, list) and isinstance(args[0], dict)
        src = self.ref("n", args[0]["n"], f"{path}.args[0]")
        return graph.call_function(operator.getitem,
                                   (src, _int(args[1], 0, 63, f"{path}.args[1]")))


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


def _distinct(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are distinct (json keeps the last of a repeated key)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        key = next(k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i]))
        raise GraphError(f"the key {key.encode('unicode_escape').decode('ascii')!r} is given "
                         "twice in one object", "graph")
    return out


def parse(text: str) -> dict[str, Any]:
    _need(len(text) <= MAX_TEXT, f"the graph is over {MAX_TEXT} bytes", "graph")
    try:
        doc = json.loads(text, parse_constant=lambda c: _need(False, f"{c} is not JSON", "graph"),
                         object_pairs_hook=_distinct)
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
    reader = _Reader(graph, inputs, [graph.placeholder(f"k{i}") for i in range(len(consts))])
    for i, node in enumerate(doc["nodes"]):
        reader.nodes.append(reader.node(node, f"graph.nodes[{i}]"))
    outs = doc["outputs"]
    _need(all(isinstance(o, dict) and len(o) == 1 and next(iter(o)) in ("n", "i", "k")
              for o in outs), "graph outputs must be tensor references", "graph.outputs")
    outs = [reader.ref(k, v, f"graph.outputs[{j}]") for j, o in enumerate(outs)
            for k, v in o.items()]
    _need(all(isinstance(o, torch.fx.Node) for o in outs), "graph outputs must be tensors",
          "graph.outputs")
    graph.output(tuple(outs))
    try:
        graph.lint()
    except RuntimeError as exc:
        raise GraphError(f"the graph is malformed: {exc}") from None
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    check_code(gm)
    check_fake(gm, metas, consts)
    return GraphBody(gm, doc, metas, consts)


# The lines torch.fx generates for a graph built from bound values: the
# signature, one call or getitem per node (with FX's "x = None" frees), the
# return.  A call's arguments hold only the tokens in TOKENS, node names and
# the schema's argument names; quoted text only STRINGS' values or 'cpu'.
NAME = r"[a-z_][a-z0-9_]*"
LINE = re.compile(rf"def forward\(self(, {NAME})*\):|    return \(({NAME}, )*({NAME},?)?\)|"
                  rf"    {NAME} = (torch\.ops\.aten\.{NAME}\.[A-Za-z0-9_]+\((?P<args>[^;]*)\)|"
                  rf"{NAME}\[[0-9]+\])(;  ({NAME} = )+None)?")
TOKENS = frozenset({"device", "type", "nan", "inf", "None", "True", "False",
                    *(str(d) for d in DTYPES.values()), "torch.strided",
                    "torch.contiguous_format", "torch.preserve_format", "torch.channels_last"})
QUOTED = frozenset({"'cpu'", *(f"'{v}'" for vs in STRINGS.values() for v in vs)})


def check_code(gm: torch.fx.GraphModule) -> None:
    """Defence in depth: the Python torch.fx generated (and exec'd) is made
    of the expected lines only, from names of our own making."""
    known = set(TOKENS)
    for n in gm.graph.nodes:
        _need(re.fullmatch(NAME, n.name) is not None, f"node name {n.name!r}", "graph.nodes")
        known.add(n.name)
        if isinstance(n.target, torch._ops.OpOverload):
            known.update(a.name for a in n.target._schema.arguments)
    code = gm.code
    _need(code.isascii(), "the generated code is not ASCII", "graph")
    for line in code.split("\n"):
        if not line.strip():
            continue
        m = LINE.fullmatch(line)
        _need(m is not None and all(c >= " " for c in line),
              f"the generated code has an unexpected line {line[:80]!r}", "graph")
        assert m is not None
        args = m.group("args") or ""
        quoted = re.findall(r"'[^']*'", args)
        words = re.findall(r"(?<![0-9A-Za-z_.])[A-Za-z_][A-Za-z0-9_.]*",
                           re.sub(r"'[^']*'", "", args))
        _need(set(quoted) <= QUOTED and set(words) <= known and '"' not in args,
              f"the generated code has an unexpected value in {line[:80]!r}", "graph")


def _safe_divisor(n: torch.fx.Node) -> bool:
    """An integer division's divisor is an int constant that cannot trap
    (not 0, not -1): torch.roll's index arithmetic, `i % 4`."""
    other = n.args[1] if len(n.args) > 1 else n.kwargs.get("other")
    return type(other) is int and other not in (0, -1)


def check_fake(gm: torch.fx.GraphModule, metas: list[tuple[torch.dtype, list[int]]],
               consts: list[torch.Tensor]) -> None:
    """Runs the graph over fake tensors: schemas, shapes and sizes hold."""
    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(dims, dtype=dtype) for dtype, dims in metas]
    args += [mode.from_tensor(t) for t in consts]
    total = [sum(t.numel() for t in args)]
    _need(total[0] <= MAX_TOTAL_ELEMENTS, f"the graph's inputs and constants hold over "
          f"{MAX_TOTAL_ELEMENTS} elements in all", "graph.inputs")

    class Checked(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            try:
                out = super().run_node(n)
            except GraphError:
                raise
            except Exception as exc:  # the op refused its arguments
                raise GraphError(f"{n.target} refused its arguments: {exc}",
                                 f"graph.nodes ({n.name})") from None
            made = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                    if isinstance(t, torch.Tensor)]
            for t in made:
                if t.numel() > MAX_ELEMENTS:
                    raise GraphError(f"{n.target} makes a tensor of {t.numel()} elements "
                                     f"(at most {MAX_ELEMENTS})", f"graph.nodes ({n.name})")
            if isinstance(n.target, torch._ops.OpOverload):
                self.account(n, made)
            return out

        def account(self, n: torch.fx.Node, made: list[torch.Tensor]) -> None:
            """Adds what n allocates to the total; refuses integral division."""
            schema = n.target._schema  # type: ignore[union-attr]
            packet = schema.name.split("::")[1]
            if packet in INT_DIVISION and not _safe_divisor(n) and any(
                    not (t.is_floating_point() or t.is_complex()) for t in made):
                raise GraphError(f"{n.target} divides integers by a tensor (a compiled "
                                 "integer division by zero, or of the least integer by -1, "
                                 "is SIGFPE); divide floating-point values or by a constant",
                                 f"graph.nodes ({n.name})")
            if all(r.alias_info is None for r in schema.returns):  # views allocate nothing
                total[0] += sum(t.numel() for t in made)
            if total[0] > MAX_TOTAL_ELEMENTS:
                raise GraphError(f"the graph's inputs, constants and intermediates hold over "
                                 f"{MAX_TOTAL_ELEMENTS} elements in all (at "
                                 f"{n.target})", f"graph.nodes ({n.name})")

    with mode:
        outs = Checked(gm).run(*args)
    _need(all(isinstance(o, torch.Tensor) for o in outs), "graph outputs must be tensors",
          "graph.outputs")

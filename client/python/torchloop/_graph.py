"""The wire form of a captured step graph ("torchloop.graph", version 1).

A captured step is an exported, core-ATen FX graph of one step over flat
tensors: inputs are the carry's tensor leaves, then one row of each input
leaf, then the body's live captured tensors ("params"); outputs are the new
carry's tensor leaves then the step output's.  This module writes it as
JSON text that loads without executing Python (no pickle, no code): the
daemon's compile worker reads it with daemon/worker/torchloop_worker/graph_loader.py, which
checks every field, allows core ATen ops only and runs the graph over fake
tensors before anything compiles.  docs/protocol.md ("Captured graphs")
has the format.

Values in `args`/`kwargs`: JSON null/bool/int/str/lists, floats (non-finite
ones as {"f": "nan"|"inf"|"-inf"}), and one-key objects: {"n": i} the value
of node i, {"i": j} graph input j, {"k": k} constant k, {"dtype": name},
{"device": "cpu"}, {"layout": name}, {"memory_format": name}.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import operator
from typing import NamedTuple, Union

import torch

FORMAT, VERSION = "torchloop.graph", 1

# what the loader accepts, by name (graph_loader.py keeps the same tables)
DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
LAYOUTS = {torch.strided: "strided"}
MEMORY_FORMATS = {torch.contiguous_format: "contiguous_format",
                  torch.preserve_format: "preserve_format",
                  torch.channels_last: "channels_last"}

Json = Union[None, bool, int, float, str, list["Json"], dict[str, "Json"]]
TreeDef = object  # adapter.flatten's structure: None, "T", ("tuple"|"list", [...]), ("dict", keys, [...])


class CaptureError(TypeError):
    """The captured graph cannot be shipped (an op or value the format lacks)."""


class Check(NamedTuple):
    """An error check export wraps in `with_effects` (torch.linalg.solve's,
    inv's, cholesky's... `aten._linalg_check_errors(info, api, is_matrix=)`):
    not shipped.  Its `info` tensor becomes an extra step output instead, and
    the package runs the check on each step's info after the scan (checks.py),
    raising eager's LinAlgError with eager's message.  The api name stays in
    the solver's process: no text of it reaches the daemon."""

    api: str
    is_matrix: bool


class Doc(NamedTuple):
    """A captured step as shipped: its adapter name, its text, and the checks
    whose info tensors are its last outputs (a tuple after the body's y)."""

    name: str
    text: str
    checks: tuple[Check, ...] = ()


Ref = dict[str, int]  # {"n": i}, {"i": j} or {"k": k}: a node, input or constant
_TOKEN: Ref = {"token": 0}  # stands for export's effect token: never shipped
_CHECK_ERRORS = "aten._linalg_check_errors.default"


def _tree(tdef: TreeDef) -> Json:
    if tdef is None or tdef == "T":
        return tdef
    assert isinstance(tdef, tuple)
    if tdef[0] == "dict":
        return ["dict", list(tdef[1]), [_tree(c) for c in tdef[2]]]
    return [tdef[0], [_tree(c) for c in tdef[1]]]


def _meta(t: torch.Tensor) -> dict[str, Json]:
    if t.dtype not in DTYPE_NAMES:
        raise CaptureError(f"a tensor of dtype {t.dtype} cannot be shipped in a captured graph")
    return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape)}


def raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements as bytes, C order (0-d and empty ones included)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _constant(t: torch.Tensor) -> dict[str, Json]:
    return {**_meta(t), "data": base64.b64encode(raw_bytes(t)).decode("ascii")}


class _Writer:
    def __init__(self, refs: dict[torch.fx.Node, Ref]) -> None:
        self.refs = refs

    def value(self, v: object, where: str) -> Json:
        if isinstance(v, torch.fx.Node):
            ref = self.refs.get(v)
            if ref is None or ref is _TOKEN:
                raise CaptureError(f"{where}: refers to {v.name}, which is not shipped")
            return ref  # type: ignore[return-value]
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if math.isnan(v):
                return {"f": "nan"}
            return {"f": "inf" if v > 0 else "-inf"} if math.isinf(v) else v
        if isinstance(v, (list, tuple)):
            return [self.value(x, where) for x in v]
        if isinstance(v, torch.dtype):
            if v not in DTYPE_NAMES:
                raise CaptureError(f"{where}: dtype {v} is not supported")
            return {"dtype": DTYPE_NAMES[v]}
        if isinstance(v, torch.device):
            if v.type != "cpu":
                raise CaptureError(f"{where}: device {v} (torchloopd runs on the CPU)")
            return {"device": "cpu"}
        if isinstance(v, torch.layout) and v in LAYOUTS:
            return {"layout": LAYOUTS[v]}
        if isinstance(v, torch.memory_format) and v in MEMORY_FORMATS:
            return {"memory_format": MEMORY_FORMATS[v]}
        raise CaptureError(f"{where}: a value of type {type(v).__name__} ({v!r}) cannot be shipped")


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.add.Tensor"
    raise CaptureError(
        f"the captured step calls {getattr(target, '__name__', target)!r}, which is not an "
        "ATen operator: only core ATen graphs can be compiled by torchloopd"
    )


def _inputs(ep: torch.export.ExportedProgram, refs: dict[torch.fx.Node, Ref],
            inputs: list[dict[str, Json]], constants: list[dict[str, Json]]) -> None:
    values = {**ep.state_dict, **ep.constants}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        kind = spec.kind.name
        if kind == "USER_INPUT":
            refs[node] = {"i": len(inputs)}
            inputs.append(_meta(node.meta["val"]))
        elif kind in ("BUFFER", "CONSTANT_TENSOR", "PARAMETER"):
            refs[node] = {"k": len(constants)}
            constants.append(_constant(values[spec.target]))
        elif kind == "TOKEN":
            refs[node] = _TOKEN
        else:
            raise CaptureError(f"the exported step has an input of kind {kind}")
    for spec in ep.graph_signature.output_specs:
        if spec.kind.name not in ("USER_OUTPUT", "TOKEN"):
            raise CaptureError(
                "the body mutates a tensor in place (the carry, an input or a captured "
                f"tensor: {spec.target or spec.arg}); torchloopd compiles pure steps only"
            )


def _effect(node: torch.fx.Node, w: "_Writer", checks: list[Check],
            infos: list[Json]) -> None:
    """with_effects(token, op, *args, **kwargs): an error check becomes an
    info output and a Check; any other effectful op cannot be shipped."""
    op = node.args[1]
    if str(op) != _CHECK_ERRORS:
        raise CaptureError(f"the captured step calls {op}, an op with side effects: only "
                           "torch.linalg's error checks are shipped (as an info output)")
    info, api = node.args[2], node.args[3]
    assert isinstance(api, str)
    checks.append(Check(api, bool(node.kwargs.get("is_matrix", True))))
    infos.append(w.value(info, str(op)))
    w.refs[node] = _TOKEN


def _as_floats(infos: list[Json], dtype: Json, nodes: list[dict[str, Json]]) -> list[Json]:
    """The info tensors (int32) as the scan's dtype: the wire carries the
    scan's dtype only, and an info (0, or an index below 2^24) is exact in it."""
    out: list[Json] = []
    for ref in infos:
        nodes.append({"op": "aten._to_copy.default", "args": [ref],
                      "kwargs": {"dtype": {"dtype": dtype}}})
        out.append({"n": len(nodes) - 1})
    return out


def write(ep: torch.export.ExportedProgram, n_carry: int, n_x: int, n_params: int,
          carry_def: TreeDef, x_def: TreeDef, out_def: TreeDef) -> tuple[str, tuple[Check, ...]]:
    """The JSON text of an exported step (user inputs: carry, x row, params)
    and its error checks (Check: their info tensors are the last outputs)."""
    constants: list[dict[str, Json]] = []
    inputs: list[dict[str, Json]] = []
    refs: dict[torch.fx.Node, Ref] = {}
    _inputs(ep, refs, inputs, constants)
    w = _Writer(refs)
    nodes: list[dict[str, Json]] = []
    outputs: list[Json] = []
    checks: list[Check] = []
    infos: list[Json] = []
    for node in ep.graph.nodes:
        if node.op == "call_function" and not node.users and str(node.target).startswith(
                "aten._assert"):
            continue  # export's metadata checks: the graph's static shapes fix them
        if node.op == "call_function" and node.target is torch.ops.higher_order.with_effects:
            _effect(node, w, checks, infos)
        elif node.op == "call_function" and node.target is operator.getitem and \
                refs.get(node.args[0]) is _TOKEN:
            refs[node] = _TOKEN  # the effect's new token
        elif node.op == "call_function":
            name = _op_name(node)
            nodes.append({"op": name, "args": w.value(list(node.args), name),
                          "kwargs": {k: w.value(v, name) for k, v in node.kwargs.items()}})
            refs[node] = {"n": len(nodes) - 1}
        elif node.op == "output":
            outputs = [w.value(v, "output") for v in node.args[0]
                       if refs.get(v) is not _TOKEN]
        elif node.op != "placeholder":
            raise CaptureError(f"the exported step has a {node.op} node ({node.name})")
    if checks:  # y becomes (y, (info, ...))
        infos = _as_floats(infos, inputs[0]["dtype"], nodes)
        assert isinstance(out_def, tuple)
        out_def = ("tuple", [out_def[1][0], ("tuple", [out_def[1][1], ("tuple", ["T"] * len(checks))])])
    doc = {
        "format": FORMAT, "version": VERSION,
        "n_carry": n_carry, "n_x": n_x, "n_params": n_params,
        "inputs": inputs, "constants": constants, "nodes": nodes, "outputs": outputs + infos,
        "carry": _tree(carry_def), "x": _tree(x_def), "out": _tree(out_def),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False), tuple(checks)


# The wire keys of the fields that define an adapter, in the order its name
# hashes them: daemon/graph/graphs.h's ADAPTER_FIELDS (tests/python/test_limits.py).
IDENTITY_FIELDS = ("body", "graph", "entry", "max_steps", "max_elements", "recompile_budget",
                   "strategy", "dynamic")


def identity(text: str, max_steps: int, max_elements: int, recompile_budget: int,
             strategy: str, dynamic: str) -> str:
    """The adapter name of a captured graph: "g." + SHA-256 of its text and
    every field of its definition joined by newlines, as the daemon computes
    it (adapter.c's adapter_graph_name): the only name a non-admin may
    register it under.  A graph takes no entry: the daemon's default, "body"."""
    fields = {"body": text, "graph": "1", "entry": "body", "max_steps": max_steps,
              "max_elements": max_elements, "recompile_budget": recompile_budget,
              "strategy": strategy, "dynamic": dynamic}
    joined = "\n".join(str(fields[k]) for k in IDENTITY_FIELDS)
    return "g." + hashlib.sha256(joined.encode()).hexdigest()[:40]

"""The compile worker's loader of captured graphs (daemon/worker/torchloop_worker/graph_loader.py)
without a daemon: a real capture round-trips and computes what the body
computes; forged documents (ops outside core ATen, lying constants,
malformed JSON, references forwards, pickles) are refused with GraphError
and nothing in them runs; 3 000 random mutations of a valid document either
load or raise GraphError, never anything else.  The same documents go
through a daemon in test_capture.py.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import sys
from typing import Any
from pathlib import Path

import pytest
import torch

import torchloop
from torchloop._graph import CaptureError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "daemon" / "worker"))
from torchloop_worker import graph_loader  # noqa: E402
from torchloop_worker.graph_loader import GraphError  # noqa: E402

W = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
# a graph adapter's whole definition (its name hashes it; test_capture.py's BOUNDS)
DEFINITION = dict(max_steps=8, max_elements=4096, recompile_budget=8, strategy="unroll",
                  dynamic="none")
IDX = torch.tensor([3, 0, 1, 2])
TWO = torch.tensor(2)  # 0-d


def step(c, x):
    """A closure-free step with baked (integer, one 0-d) constants and a live one."""
    s, _ = c
    return (0.3 * s[IDX] + torch.tanh(W @ x) * TWO, None), {"y": s * x, "n": None}


def capture(body, carry, x_row) -> str:
    """The graph text the package would ship for body (no daemon involved)."""
    from torchloop.adapter import flatten
    from torchloop.capture import Capturer

    leaves: list[torch.Tensor] = []
    cdef = flatten(carry, "carry", leaves)
    n = len(leaves)
    xdef = flatten(x_row, "inputs", leaves)
    g, args, result = Capturer().capture(body, carry, x_row)
    g.bind(args, leaves[:n], leaves[n:], result, torch.float64)
    return g.document(args, leaves, n, cdef, xdef, DEFINITION)[1]


@pytest.fixture(scope="module")
def doc_text() -> str:
    return capture(step, (torch.rand(4, dtype=torch.float64), None), torch.rand(4, dtype=torch.float64))


def test_a_captured_step_loads_and_computes_what_the_body_computes(doc_text: str) -> None:
    body = graph_loader.load(doc_text)
    c, x = torch.rand(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    (new, params), y = body(((c, None), (W,)), x)
    (ref_new, _), ref_y = step((c, None), x)
    torch.testing.assert_close(new[0], ref_new, rtol=0, atol=1e-15)
    torch.testing.assert_close(y["y"], ref_y["y"], rtol=0, atol=0)
    assert new[1] is None and y["n"] is None and params[0] is W


def test_the_document_names_only_core_aten_and_carries_the_baked_constant(doc_text: str) -> None:
    doc = json.loads(doc_text)
    assert doc["n_carry"] == 1 and doc["n_x"] == 1 and doc["n_params"] == 1
    assert all(n["op"].startswith("aten.") or n["op"] == "getitem" for n in doc["nodes"])
    consts = {tuple(k["shape"]): k for k in doc["constants"]}
    assert sorted(consts) == [(), (4,)] and all(k["dtype"] == "int64" for k in consts.values())
    values = {shape: torch.frombuffer(bytearray(base64.b64decode(k["data"])), dtype=torch.int64).tolist()
              for shape, k in consts.items()}
    assert values == {(4,): [3, 0, 1, 2], (): [2]}


def forged(doc_text: str, how: str) -> str:
    doc = json.loads(doc_text)
    if how == "op outside aten":
        doc["nodes"][0]["op"] = "torchloop.cat_into_.default"
    elif how == "python callable":
        doc["nodes"][0]["op"] = "builtins.eval"
    elif how == "non-core aten op":
        doc["nodes"][0]["op"] = "aten.linear.default"
    elif how == "denied op":
        doc["nodes"].append({"op": "aten.empty.memory_format", "args": [[4]], "kwargs": {}})
    elif how == "constant lies about its size":  # 8 bytes said to be 400 float64
        doc["constants"].append({"dtype": "float64", "shape": [400],
                                 "data": base64.b64encode(bytes(8)).decode()})
    elif how == "forward reference":
        doc["nodes"][0]["args"][0] = {"n": len(doc["nodes"]) - 1}
    elif how == "input out of range":
        doc["nodes"][0]["args"][0] = {"i": 99}
    elif how == "unknown value tag":
        doc["nodes"][0]["args"].append({"pickle": "cos\nsystem\n"})
    elif how == "wrong arity":
        doc["nodes"][0]["args"] = []
    elif how == "outputs miscounted":
        doc["outputs"] = doc["outputs"][:1]
    elif how == "huge intermediate":
        doc["nodes"].append({"op": "aten.full.default", "args": [[1 << 20, 1 << 10], 1.0],
                             "kwargs": {}})
    elif how == "version":
        doc["version"] = 2
    elif how == "an effectful op":  # export's linalg check: the package ships its info instead
        doc["nodes"].append({"op": "aten._linalg_check_errors.default",
                             "args": [{"n": 0}, "torch.linalg.solve"], "kwargs": {"is_matrix": True}})
    elif how == "with_effects":
        doc["nodes"].append({"op": "higher_order.with_effects", "args": [], "kwargs": {}})
    elif how == "code in a kwarg key":  # issue 53 row 1, as it ran on the old loader
        doc["nodes"][-1]["kwargs"] = {payload("\r", MARKER): 1}
    elif how == "unchecked indices":  # row 3: the eager kernel wrote out of bounds
        doc["nodes"].append({"op": "aten.max_pool2d_with_indices_backward.default",
                             "args": [{"i": 2}, {"i": 2}, [1, 1], [1, 1], [0, 0], [1, 1],
                                      False, {"k": 0}], "kwargs": {}})
    elif how == "intermediates over the total":  # row 5: each under the per-tensor cap
        doc["nodes"] += [{"op": "aten.full.default", "args": [[1 << 24], 1.0], "kwargs": {}}
                         for _ in range(5)]
    elif how == "integer remainder":  # SIGFPE in a compiled kernel when dividing by 0
        doc["nodes"].append({"op": "aten.remainder.Scalar", "args": [{"k": 0}, 0],
                             "kwargs": {}})
    return json.dumps(doc)


FORGERIES = ["op outside aten", "python callable", "non-core aten op", "denied op",
             "constant lies about its size", "forward reference", "input out of range",
             "unknown value tag", "wrong arity", "outputs miscounted", "huge intermediate",
             "version", "code in a kwarg key", "unchecked indices",
             "intermediates over the total", "integer remainder", "an effectful op",
             "with_effects"]
# where "code in a kwarg key" would write (test_capture.py checks it through a daemon)
MARKER = f"/tmp/torchloop-graph-marker-{os.getpid()}"


def payload(sep: str, marker: str) -> str:
    """A kwarg key that, pasted into torch.fx's generated source with sep
    ending lines, writes marker when the module is exec'd: the line is
    closed, the statement runs at module level, and the rest of the
    generated function becomes the body of a new one."""
    return f"alpha=1){sep}open({marker!r}, 'w').close(){sep}def f():{sep}    dict(y"


@pytest.mark.parametrize("how", FORGERIES)
def test_a_forged_document_is_refused_with_graph_error(doc_text: str, how: str) -> None:
    with pytest.raises(GraphError) as info:
        graph_loader.load(forged(doc_text, how))
    assert info.value.code == "BAD_GRAPH" and info.value.message


class Boom:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("where", ["constant", "whole text", "torch.save zip"])
def test_a_pickle_anywhere_is_never_unpickled(doc_text: str, tmp_path: Path, where: str) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(Boom(str(marker)))
    if where == "constant":
        doc = json.loads(doc_text)
        doc["constants"][0] = {"dtype": "uint8", "shape": [len(payload)],
                               "data": base64.b64encode(payload).decode()}
        text = json.dumps(doc)
    elif where == "whole text":
        text = payload.decode("latin-1")
    else:
        path = tmp_path / "blob.pt"
        torch.save({"x": Boom(str(marker))}, path)
        text = path.read_bytes().decode("latin-1")
    marker.unlink(missing_ok=True)
    try:
        graph_loader.load(text)
    except GraphError:
        pass
    assert not marker.exists(), "the loader ran a pickle"


def test_three_thousand_mutations_load_or_raise_graph_error(doc_text: str) -> None:
    """A fuzz of the loader: byte flips, truncations, and JSON-level swaps of
    values; every outcome is a GraphBody or GraphError."""
    rng = random.Random(1234)
    doc = json.loads(doc_text)
    values: list[object] = [None, True, 0, -1, 1 << 62, 1.5, "x", [], {}, {"n": 0}, {"i": -1},
                            {"k": 5}, {"dtype": "complex64"}, {"f": "nan"}, [[[]]], "aten.add.Tensor"]
    loaded = 0
    for i in range(3000):
        if i % 2:
            raw = bytearray(doc_text.encode())
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(32, 127)
            text = raw[: rng.randrange(len(raw))].decode() if i % 7 == 0 else raw.decode()
        else:
            mutated = json.loads(doc_text)
            node = rng.choice(mutated["nodes"])
            target = rng.choice([node["args"], mutated["outputs"], mutated["inputs"],
                                 mutated["constants"], mutated["out"]])
            if target:
                target[rng.randrange(len(target))] = rng.choice(values)
            text = json.dumps(mutated)
        try:
            graph_loader.load(text)
            loaded += 1
        except GraphError:
            pass
    assert loaded < 3000 and doc["nodes"]


def test_a_body_returning_a_python_number_cannot_be_shipped() -> None:
    with pytest.raises(TypeError, match="leaves must be tensors or None"):
        capture(lambda c, x: (c + x, 1.0), torch.rand(2, dtype=torch.float64),
                torch.rand(2, dtype=torch.float64))


def test_capture_error_is_a_type_error() -> None:
    assert issubclass(CaptureError, TypeError) and torchloop.loop_adapter


SEPARATORS = ["\r", "\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\r\n"]


@pytest.mark.parametrize("sep", SEPARATORS, ids=[repr(s) for s in SEPARATORS])
@pytest.mark.parametrize("where", ["kwarg key", "string value", "tree key"])
def test_code_in_a_key_or_string_never_runs(doc_text: str, tmp_path: Path, sep: str,
                                            where: str) -> None:
    """Issue 53 row 1: the old loader wrote the marker for "\\r" in a kwarg key."""
    marker = tmp_path / "ran"
    doc = json.loads(doc_text)
    code = payload(sep, str(marker))
    if where == "kwarg key":
        doc["nodes"][-1]["kwargs"] = {code: 1}
    elif where == "string value":
        doc["nodes"].append({"op": "aten.div.Tensor_mode", "args": [{"i": 0}, {"i": 1}],
                             "kwargs": {"rounding_mode": code}})
    else:
        doc["out"][1][1][1][0] = code
    with pytest.raises(GraphError) as info:
        graph_loader.load(json.dumps(doc))
    assert info.value.code == "BAD_GRAPH"
    assert not marker.exists(), "the loader ran text of the graph"


@pytest.mark.parametrize("node, says", [
    ({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}], "kwargs": {"beta": 2}},
     "'beta' is not an argument of aten::add.Tensor"),
    ({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}], "kwargs": {"other": {"i": 0}}},
     "'other' is given twice"),
    ({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}, 1, 2], "kwargs": {}},
     "aten::add.Tensor takes at most 2 positional"),
    ({"op": "aten.add.Tensor", "args": [{"i": 0}], "kwargs": {}}, "needs argument other"),
    ({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}], "kwargs": {"alpha": "1"}},
     "must be a number"),
    ({"op": "aten.sum.dim_IntList", "args": [{"i": 0}, [0.5]], "kwargs": {}}, "int64"),
    ({"op": "aten.cat.default", "args": [{"i": 0}], "kwargs": {}}, "list of Tensor"),
    ({"op": "aten.div.Tensor_mode", "args": [{"i": 0}, {"i": 1}],
      "kwargs": {"rounding_mode": "ceil"}}, "must be one of ['trunc', 'floor']"),
    ({"op": "aten.full.default", "args": [[2], 1.0], "kwargs": {"dtype": {"dtype": "os"}}},
     "must be one of"),
    ({"op": "aten.add.out", "args": [{"i": 0}, {"i": 1}], "kwargs": {}}, "mutates"),
    ({"op": "aten.add.str", "args": ["a", "b"], "kwargs": {}}, "mutates its arguments or"),
    ({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}], "kwargs": {}, "meta": 1},
     "nothing else"),
    ({"op": "getitem", "args": [{"i": 0}, 0], "kwargs": {}}, "getitem takes"),
    ({"op": "aten.linalg_lu_solve.default", "args": [{"i": 2}, {"k": 0}, {"i": 2}],
      "kwargs": {}}, "pivots must be output 1 of a linalg_lu_factor_ex node"),
])
def test_a_node_is_bound_to_its_schema(doc_text: str, node: dict, says: str) -> None:
    doc = json.loads(doc_text)
    doc["nodes"].append(node)
    with pytest.raises(GraphError) as info:
        graph_loader.load(json.dumps(doc))
    assert says in info.value.message, info.value.message


def test_a_key_given_twice_in_the_text_is_refused(doc_text: str) -> None:
    doc = json.loads(doc_text)
    doc["nodes"].append({"op": "aten.add.Tensor", "args": [{"i": 0}, {"i": 1}],
                         "kwargs": {"alpha": 1}})
    text = json.dumps(doc).replace('"alpha": 1', '"alpha": 1, "alpha": 2')
    with pytest.raises(GraphError, match="'alpha' is given twice"):
        graph_loader.load(text)


@pytest.mark.parametrize("op", [
    "max_pool2d_with_indices_backward.default", "max_pool3d_with_indices_backward.default",
    "max_unpool2d.default", "embedding_dense_backward.default", "_embedding_bag.default",
    "nll_loss_forward.default", "nll_loss2d_forward.default", "empty.memory_format",
    "as_strided.default", "_local_scalar_dense.default", "linear.default"])
def test_an_op_outside_the_allow_list_is_refused_by_name(doc_text: str, op: str) -> None:
    doc = json.loads(doc_text)
    doc["nodes"].append({"op": f"aten.{op}", "args": [], "kwargs": {}})
    with pytest.raises(GraphError) as info:
        graph_loader.load(json.dumps(doc))
    assert f"aten.{op} is not allowed" in info.value.message


@pytest.mark.parametrize("op, args, ok", [
    ("remainder.Scalar", [{"k": 0}, 0], False),
    ("fmod.Scalar", [{"k": 0}, -1], False),  # INT_MIN / -1 traps too
    ("remainder.Scalar", [{"k": 0}, False], False),  # a bool is 0, not an int constant
    ("remainder.Scalar", [{"k": 0}, 3], True),  # torch.roll's index arithmetic
    ("fmod.Scalar", [{"k": 0}, -4], True),
    ("floor_divide.default", [{"k": 0}, {"k": 1}], False),
    ("div.Tensor_mode", [{"k": 0}, {"k": 1}], False),
    ("div.Tensor", [{"k": 0}, {"k": 1}], True),  # true division: float64 result
    ("remainder.Scalar", [{"i": 0}, 3], True),
])
def test_integer_division_by_a_tensor_is_refused_by_a_safe_constant_loads(
        doc_text: str, op: str, args: list, ok: bool) -> None:
    doc = json.loads(doc_text)
    node: dict = {"op": f"aten.{op}", "args": args, "kwargs": {}}
    if op == "div.Tensor_mode":
        node["kwargs"] = {"rounding_mode": "floor"}
    doc["nodes"].append(node)
    if ok:
        graph_loader.load(json.dumps(doc))
        return
    with pytest.raises(GraphError, match="divides integers"):
        graph_loader.load(json.dumps(doc))


@pytest.mark.parametrize("count", [3, 4])
def test_the_sum_of_intermediates_is_bounded(doc_text: str, count: int) -> None:
    """Issue 53 row 5: each 2^24 tensor is under the per-tensor cap; three
    of them fit MAX_TOTAL_ELEMENTS (2^26) with the graph's own, four do not."""
    doc = json.loads(doc_text)
    doc["nodes"] += [{"op": "aten.full.default", "args": [[1 << 24], 1.0], "kwargs": {}}
                     for _ in range(count)]
    if count == 3:
        graph_loader.load(json.dumps(doc))
        return
    with pytest.raises(GraphError, match="elements in all"):
        graph_loader.load(json.dumps(doc))


def test_views_do_not_count_against_the_total(doc_text: str) -> None:
    doc = json.loads(doc_text)
    doc["nodes"].append({"op": "aten.full.default", "args": [[1 << 24], 1.0], "kwargs": {}})
    doc["nodes"] += [{"op": "aten.view.default", "args": [{"n": len(doc["nodes"]) - 1},
                                                          [1 << 12, 1 << 12]], "kwargs": {}}
                     for _ in range(8)]
    graph_loader.load(json.dumps(doc))


def test_the_generated_code_check_refuses_an_unexpected_line(doc_text: str) -> None:
    gm = graph_loader.load(doc_text).gm
    graph_loader.check_code(gm)
    for n in gm.graph.nodes:  # what a hole in the binder would let through
        if n.op == "call_function" and n.target is torch.ops.aten.sum.dim_IntList:
            n.kwargs = {"dtype": "x')\nimport os\n#"}
    gm.recompile()
    with pytest.raises(GraphError, match="unexpected"):
        graph_loader.check_code(gm)


def test_a_graphs_dry_run_takes_generated_inputs_not_the_requests(doc_text: str) -> None:
    """Issue 53 row 3: no request data runs through eager ATen for a graph;
    a source body's dry run still takes the request's own inputs."""
    from torchloop_worker.compile import eager_runs
    from torchloop_worker.job import Job, load_body

    t4 = {"k": "T", "s": [4]}
    carry = {"k": "tuple", "c": [{"k": "tuple", "c": [t4, None]},
                                 {"k": "tuple", "c": [{"k": "T", "s": [4, 4]}]}]}
    inputs = {"k": "T", "s": [3, 4]}
    sample = [torch.full(s, 7.0, dtype=torch.float64).numpy().tobytes()
              for s in ([4], [4, 4], [3, 4])]
    job = Job(body_source="", body_file="", entry="", body_graph=doc_text, steps=3,
              carry=carry, inputs=inputs, sample=sample)
    eager = eager_runs(job, load_body(job))
    assert eager.random and all(bool((a < 1).all()) for a in eager.args)
    src = Job(body_source="def body(c, x):\n    return c + x, c\n", body_file="<t>",
              entry="body", steps=3, carry=t4, inputs=inputs, sample=sample[::2])
    eager = eager_runs(src, load_body(src))
    assert not eager.random and all(bool((a == 7).all()) for a in eager.args)


def solve_step(c: tuple[torch.Tensor, None], x: torch.Tensor) -> tuple[Any, torch.Tensor]:
    y, _ = c
    A = torch.eye(4, dtype=y.dtype) * (2.0 + x[0]) + torch.outer(y, y) * 0.1
    y1 = torch.linalg.solve(A, y)
    return (y1 + torch.linalg.inv(A) @ x, None), torch.linalg.det(A)


def test_a_step_with_linalg_checks_ships_their_infos_as_outputs_and_no_token() -> None:
    """torch.linalg.solve and inv: export's effect token and with_effects
    checks are not in the text; each check's info is an extra output (in the
    scan's dtype) after the body's y, and the document lists the checks;
    the loaded graph computes what the body computes, infos 0."""
    from torchloop._graph import Check

    from torchloop.adapter import flatten
    from torchloop.capture import Capturer

    carry, x = (torch.rand(4, dtype=torch.float64), None), torch.rand(4, dtype=torch.float64)
    leaves: list[torch.Tensor] = []
    cdef = flatten(carry, "carry", leaves)
    xdef = flatten(x, "inputs", leaves)
    g, args, result = Capturer().capture(solve_step, carry, x)
    g.bind(args, leaves[:1], leaves[1:], result, torch.float64)
    doc = g.document(args, leaves, 1, cdef, xdef, DEFINITION)
    assert doc.checks == (Check("torch.linalg.solve", True), Check("linalg.inv", True))
    assert "with_effects" not in doc.text and "check_errors" not in doc.text
    assert "token" not in doc.text
    body = graph_loader.load(doc.text)
    ((new, _), _), (y, infos) = body((carry, ()), x)
    (ref_new, _), ref_y = solve_step(carry, x)
    torch.testing.assert_close(new, ref_new, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(y, ref_y, rtol=1e-13, atol=1e-13)
    assert [t.dtype for t in infos] == [torch.float64] * 2 and all(int(t) == 0 for t in infos)

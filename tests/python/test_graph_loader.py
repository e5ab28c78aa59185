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
import pickle
import random
import sys
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
    return json.dumps(doc)


FORGERIES = ["op outside aten", "python callable", "non-core aten op", "denied op",
             "constant lies about its size", "forward reference", "input out of range",
             "unknown value tag", "wrong arity", "outputs miscounted", "huge intermediate",
             "version"]


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

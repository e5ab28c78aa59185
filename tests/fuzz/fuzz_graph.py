"""Graph-format fuzzer: mutated captured graphs through the worker's loader.

Every document of tests/fuzz/graph_corpus/*.json (captured by the package,
`--write-corpus` makes them again) is mutated -- strings, keys (control
characters, code that would create a file in a watched scratch directory),
numbers, structure, whole nodes, op names, raw bytes -- and loaded with
daemon/worker/torchloop_worker/graph_loader.py `load` in this process.
Each one must load or raise GraphError, nothing else, and the scratch
directory must stay empty.  Runs for FUZZ_SECONDS (default 60) with the seed
printed (FUZZ_SEED replays it); ends with a line counting mutants and findings, a failing
document saved under build/fuzz/graph-failures/ and exit status 1.

Usage: .venv/bin/python tests/fuzz/fuzz_graph.py [--write-corpus]
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "daemon" / "worker"))
sys.path.insert(0, str(ROOT / "client" / "python"))
CORPUS = ROOT / "tests" / "fuzz" / "graph_corpus"
FAILURES = ROOT / "build" / "fuzz" / "graph-failures"

from torchloop_worker import graph_loader  # noqa: E402
from torchloop_worker.graph_loader import GraphError  # noqa: E402
from torchloop_worker.graph_schema import PACKETS  # noqa: E402

SEPARATORS = ["\r", "\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028",
              "\u2029", "\x00", "\t", ";", "#"]
OPS = sorted(PACKETS) + ["max_pool2d_with_indices_backward", "max_unpool2d", "empty",
                         "as_strided", "embedding_dense_backward", "nll_loss_forward",
                         "_local_scalar_dense", "linear", "__import__", "eval"]
OVERLOADS = ["default", "Tensor", "Scalar", "out", "dim_IntList", "Tensor_mode", "str", "t",
             "memory_format", "self", "two", "int", "Tensor_out"]
NUMBERS: list[Any] = [0, 1, -1, 2, 63, 64, 1 << 24, (1 << 24) + 1, 1 << 31, 1 << 62, 1 << 63,
                      -(1 << 63) - 1, 1 << 100, 0.5, -0.0, 1e308, 5e-324, True, False, None,
                      {"f": "nan"}, {"f": "inf"}, {"f": "os"}]


def number(rng: random.Random, more: list[Any] | None = None) -> Any:
    """One of NUMBERS (or more), a copy: a mutation may change what it gets,
    and NUMBERS' own maps must never become part of a document (they would
    grow from mutant to mutant, and a later one would hold itself)."""
    return copy.deepcopy(rng.choice(NUMBERS + (more or [])))


def code(scratch: Path, rng: random.Random) -> str:
    """Text that creates a file in scratch if it is ever run as Python."""
    sep = rng.choice(SEPARATORS)
    mark = str(scratch / f"m{rng.randrange(1000)}")
    return rng.choice([
        f"alpha=1){sep}open({mark!r}, 'w').close(){sep}def f():{sep}    dict(y",
        f"x{sep}__import__('os').mknod({mark!r}){sep}",
        f"'){sep}import pathlib; pathlib.Path({mark!r}).touch(){sep}#",
        f"floor{sep}open({mark!r},'w')",
        f"__import__('os').system('touch {mark}')",
    ])


def paths(v: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON value (list indices, dict keys)."""
    out = [at]
    if isinstance(v, list):
        for i, x in enumerate(v):
            out += paths(x, at + (i,))
    elif isinstance(v, dict):
        for k, x in v.items():
            out += paths(x, at + (k,))
    return out


def get(v: Any, at: tuple[Any, ...]) -> Any:
    for k in at:
        v = v[k]
    return v


def replace(doc: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    get(doc, at[:-1])[at[-1]] = new
    return doc


def mutate_value(doc: Any, rng: random.Random, scratch: Path, docs: list[Any]) -> Any:
    at = rng.choice(paths(doc))
    # a copy: the value put back may hold it twice, never a part of doc itself
    # (doc's own subtree under a new key of its own would make a cycle)
    old = copy.deepcopy(get(doc, at))
    other = rng.choice(docs)
    pick: list[Callable[[], Any]] = [
        lambda: number(rng),
        lambda: code(scratch, rng),
        lambda: (old if isinstance(old, str) else "s") + rng.choice(SEPARATORS) + "x",
        lambda: [old, old] if not isinstance(old, list) else old + old[:1],
        lambda: old[:-1] if isinstance(old, list) else {},
        lambda: {rng.choice(["n", "i", "k", "f", "dtype", "device", "layout",
                             "memory_format", code(scratch, rng)]): number(rng, ["cpu"])},
        lambda: copy.deepcopy(get(other, rng.choice(paths(other)))),
    ]
    return replace(doc, at, rng.choice(pick)())


def mutate_key(doc: Any, rng: random.Random, scratch: Path) -> Any:
    dicts = [at for at in paths(doc) if isinstance(get(doc, at), dict) and get(doc, at)]
    nodes = doc.get("nodes")
    node = rng.choice(nodes) if isinstance(nodes, list) and nodes else {}
    if isinstance(node, dict) and rng.random() < 0.5:
        kw = node.setdefault("kwargs", {}) if isinstance(node.get("kwargs", {}), dict) else {}
        kw[rng.choice([code(scratch, rng), "alpha", "self", "other", "dtype", "out",
                       "rounding_mode", "__class__"])] = number(rng, ["floor"])
        return doc
    if not dicts:
        return doc
    d = get(doc, rng.choice(dicts))
    key = rng.choice(list(d))
    d[rng.choice([code(scratch, rng), key + rng.choice(SEPARATORS), key.upper(), ""])] = d.pop(key)
    return doc


def mutate_op(doc: Any, rng: random.Random) -> Any:
    nodes = doc.get("nodes")
    if isinstance(nodes, list) and nodes:
        node = rng.choice(nodes)
        if isinstance(node, dict):
            node["op"] = rng.choice(["getitem", f"aten.{rng.choice(OPS)}.{rng.choice(OVERLOADS)}",
                                     f"torch.{rng.choice(OPS)}", "builtins.eval"])
    return doc


def mutate_tree(doc: Any, rng: random.Random, scratch: Path) -> Any:
    """A key of the carry, x or out trees: dict keys become payloads."""
    field = rng.choice(["carry", "x", "out"])
    doc[field] = ["dict", [code(scratch, rng)], [doc.get(field)]]
    return doc


def mutate_text(text: str, rng: random.Random) -> str:
    raw = bytearray(text.encode())
    how = rng.randrange(4)
    if how == 0:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
    elif how == 1:
        raw = raw[: rng.randrange(len(raw))]
    elif how == 2:  # a key given twice
        return text.replace('"kwargs":{', '"kwargs":{"alpha":1,"alpha":2,', 1)
    else:
        i = rng.randrange(len(raw))
        raw[i:i] = raw[rng.randrange(len(raw)):][: rng.randrange(64)]
    return raw.decode("utf-8", "replace")


def mutant(docs: list[Any], texts: list[str], rng: random.Random, scratch: Path) -> str:
    i = rng.randrange(len(docs))
    if rng.random() < 0.15:
        return mutate_text(texts[i], rng)
    doc = copy.deepcopy(docs[i])
    for _ in range(rng.randint(1, 3)):
        doc = rng.choice([lambda d: mutate_value(d, rng, scratch, docs),
                          lambda d: mutate_key(d, rng, scratch) if isinstance(d, dict) else d,
                          lambda d: mutate_op(d, rng) if isinstance(d, dict) else d,
                          lambda d: mutate_tree(d, rng, scratch) if isinstance(d, dict) else d,
                          ])(doc)
    return json.dumps(doc)


def fail(text: str, n: int, why: str) -> None:
    FAILURES.mkdir(parents=True, exist_ok=True)
    saved = FAILURES / f"failure-{os.getpid()}-{n}.json"
    saved.write_text(text)
    print(f"fuzz_graph: FAILED at mutation {n}: {why}\nfuzz_graph: the document is {saved}",
          flush=True)


def run(seconds: float, seed: int) -> int:
    # the fake run logs each op that refuses its arguments: GraphError says it
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    texts = [p.read_text() for p in sorted(CORPUS.glob("*.json"))]
    if not texts:
        print(f"fuzz_graph: no corpus in {CORPUS}")
        return 1
    for t in texts:  # the corpus itself must load
        graph_loader.load(t)
    docs = [json.loads(t) for t in texts]
    rng = random.Random(seed)
    passed = failed = loaded = 0
    end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix="fuzz-graph-") as tmp:
        scratch = Path(tmp)
        while time.monotonic() < end and not failed:
            text = mutant(docs, texts, rng, scratch)
            try:
                graph_loader.load(text)
                loaded += 1
            except GraphError:
                pass
            except BaseException as exc:  # anything but GraphError is a finding
                failed += 1
                fail(text, passed + failed, "".join(traceback.format_exception(exc))[-3000:])
            appeared = list(scratch.iterdir())
            if appeared:
                failed += 1
                fail(text, passed + failed, f"a file appeared: {appeared}")
            elif not failed:
                passed += 1
    # not "N passed, N failed": that closing line is the whole suite's (run-tests.sh)
    print(f"fuzz_graph: seed {seed}, {len(texts)} corpus documents, {passed} mutants held "
          f"({loaded} loaded, the rest refused with GraphError), {failed} findings")
    return 1 if failed else 0


def write_corpus() -> None:
    """Captures a few bodies with the package (as test_graph_loader.capture does)."""
    import torch
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    sys.path.insert(0, str(ROOT / "tests" / "helpers"))
    from test_graph_loader import capture, step
    from bodyforms import N, W0, make

    f64 = dict(dtype=torch.float64)
    import runpy
    scope = runpy.run_path(str(ROOT / "examples" / "bodies" / "gru_carry.py"))
    h, w, u = torch.rand(2, 3, **f64), torch.rand(3, 3, **f64), torch.rand(4, 3, **f64)
    bodies = {
        "step": (step, (torch.rand(4, **f64), None), torch.rand(4, **f64)),
        "closure": (make(0.3, W0.clone()), torch.rand(N, **f64), torch.rand(N, **f64)),
        "gru": (scope["cell"], (h, w, w, w, u, u, u), torch.rand(2, 4, **f64)),
        "dict_tree": (lambda c, x: ({"a": c["a"].cumsum(0) * x[0], "b": c["b"].clamp(0, 1)},
                                    torch.where(x > 0.5, x, -x).amax()),
                      {"a": torch.rand(3, **f64), "b": torch.rand(2, 2, **f64)},
                      torch.rand(3, **f64)),
    }
    from test_linalg_ops import Model, initial, inputs
    bodies["linalg"] = (Model().body(), (initial(), None), tuple(t[0] for t in inputs()))
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, (body, carry, x) in bodies.items():
        (CORPUS / f"{name}.json").write_text(capture(body, carry, x))


def main() -> int:
    if "--write-corpus" in sys.argv[1:]:
        write_corpus()
        return 0
    seconds = float(os.environ.get("FUZZ_SECONDS", "60"))
    seed = int(os.environ.get("FUZZ_SEED", str(random.SystemRandom().randrange(1 << 32))))
    print(f"fuzz_graph: graph_loader for {seconds:g}s, seed {seed} (FUZZ_SEED={seed} replays it)",
          flush=True)
    return run(seconds, seed)


if __name__ == "__main__":
    sys.exit(main())

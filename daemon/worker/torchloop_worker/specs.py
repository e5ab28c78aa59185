"""Specs -- tree structure and leaf shapes, as the daemon sends them -- and
the trees of tensors built from them.

A spec node is None, {"k": "T", "s": [dims]}, {"k": "tuple"|"list", "c": [...]}
or {"k": "dict", "keys": [...], "c": [...]}.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from .errors import JobError

# A spec node as the daemon sends it; None for a None leaf.
Spec = Union[dict[str, Any], None]
# A tree of tensors: what a body takes and returns.
Tree = Union[torch.Tensor, None, tuple["Tree", ...], list["Tree"], dict[str, "Tree"]]

def spec_path(path: str, node: dict[str, Any], i: int) -> str:
    if node["k"] == "dict":
        return f'{path}["{node["keys"][i]}"]'
    return f"{path}[{i}]"


def spec_leaves(spec: Spec) -> list[list[int]]:
    """Shapes of the tensor leaves in depth-first order."""
    if spec is None:
        return []
    if spec["k"] == "T":
        return [list(spec["s"])]
    out: list[list[int]] = []
    for child in spec["c"]:
        out.extend(spec_leaves(child))
    return out


def spec_build(spec: Spec, leaves: list[torch.Tensor], pos: list[int]) -> Tree:
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


def tree_spec(tree: object, path: str) -> Spec:
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


def flat_tensors(tree: Tree) -> list[torch.Tensor]:
    if tree is None:
        return []
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree
    out: list[torch.Tensor] = []
    for v in values:
        out.extend(flat_tensors(v))
    return out


def strip_dtype(spec: Spec) -> Spec:
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


def spec_has_batch(spec: Spec) -> bool:
    return any(BATCH in s for s in spec_leaves(spec))


def spec_bind(spec: Spec, batch: int) -> Spec:
    """The spec with its batch dimensions set to batch."""
    if spec is None:
        return None
    if spec["k"] == "T":
        return {**spec, "s": [batch if d == BATCH else d for d in spec["s"]]}
    return {**spec, "c": [spec_bind(c, batch) for c in spec["c"]]}


def probe_batches(carry: Spec, inputs: Spec, steps: int) -> tuple[int, int]:
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


def batch_y_spec(y1: Spec, y2: Spec, b1: int, b2: int, path: str = "outputs") -> Spec:
    """The per-step output spec with -1 where it follows the batch size, from
    the dry runs at b1 and b2; any other size that changes with the batch is
    refused (the graph's buffers are laid out from this spec)."""
    if y1 is None or y2 is None:
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


def carry_mismatch(expected: Spec, actual: Spec, path: str,
                   dtype: str) -> tuple[str, str] | None:
    """(the leaf path, what differs) of the first difference between the
    carry spec and what the body returned."""
    if expected is None or actual is None:
        if expected is None and actual is None:
            return None
        return path, f"expected {describe(expected)}, got {describe(actual)}"
    if expected["k"] != actual["k"]:
        return path, f"expected {describe(expected)}, got {describe(actual)}"
    if expected["k"] == "T":
        if list(expected["s"]) != list(actual["s"]):
            return path, f"expected shape {tuple(expected['s'])}, got {tuple(actual['s'])}"
        if actual.get("dtype") != dtype:
            return path, f"expected dtype {dtype}, got {actual.get('dtype')}"
        return None
    if expected["k"] == "dict" and list(expected["keys"]) != list(actual["keys"]):
        return path, f"expected keys {expected['keys']}, got {actual['keys']}"
    if len(expected["c"]) != len(actual["c"]):
        return path, (f"expected a {expected['k']} of {len(expected['c'])}, "
                      f"got {len(actual['c'])}")
    for i, (e, a) in enumerate(zip(expected["c"], actual["c"])):
        found = carry_mismatch(e, a, spec_path(path, expected, i), dtype)
        if found:
            return found
    return None


def describe(spec: Spec) -> str:
    if spec is None:
        return "None"
    if spec["k"] == "T":
        return f"a tensor of shape {tuple(spec['s'])}"
    return f"a {spec['k']}"


def map_tensors(tree: Tree, fn: Callable[[torch.Tensor], torch.Tensor]) -> Tree:
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(map_tensors(v, fn) for v in tree)
    if isinstance(tree, list):
        return [map_tensors(v, fn) for v in tree]
    return {k: map_tensors(v, fn) for k, v in tree.items()}



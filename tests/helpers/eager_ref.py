"""Eager PyTorch reference for the end-to-end tests (independent of the daemon).

usage: eager_ref.py --body FILE --entry FN --dir DIR [--grad] [--fd]

Reads DIR/in.json -- {"carry": TREE, "inputs": TREE, "cot_carry"?: TREE,
"cot_outputs"?: TREE}, trees of .npy leaves as docs/cli.md describes -- runs the
scan as a plain Python loop over the body, and writes DIR/ref/ (one .npy per
leaf and tree.json) with "carry" and "outputs"; with --grad also
"grad_carry"/"grad_inputs" from torch.autograd, and with --fd the same
gradients by central finite differences ("fd_carry"/"fd_inputs").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from typing import Any, Callable

import numpy as np
import torch
import torch.utils._pytree as pytree


def load_tree(node: Any, base: str) -> Any:
    if node is None:
        return None
    if isinstance(node, str):
        return torch.from_numpy(np.load(os.path.join(base, node)))
    if isinstance(node, list):
        return [load_tree(v, base) for v in node]
    if set(node) == {"__tuple__"}:
        return tuple(load_tree(v, base) for v in node["__tuple__"])
    return {k: load_tree(v, base) for k, v in node.items()}


def save_tree(tree: Any, base: str, root: str, counter: list[int]) -> Any:
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        name = f"{root}_{counter[0]}.npy"
        counter[0] += 1
        np.save(os.path.join(base, name), tree.detach().numpy())
        return name
    if isinstance(tree, tuple):
        return {"__tuple__": [save_tree(v, base, root, counter) for v in tree]}
    if isinstance(tree, list):
        return [save_tree(v, base, root, counter) for v in tree]
    return {k: save_tree(v, base, root, counter) for k, v in tree.items()}


# torch's pytree keeps None as a leaf; here None is an empty subtree (as in
# jax and the wire's trees).
def tmap(fn: Callable[..., Any], *trees: Any) -> Any:
    return pytree.tree_map(lambda *x: None if x[0] is None else fn(*x), trees[0], *trees[1:])


def leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if x is not None]


def steps_of(inputs: Any) -> int:
    return int(leaves(inputs)[0].shape[0])


def scan(body: Callable[..., Any], carry: Any, inputs: Any) -> tuple[Any, Any]:
    ys = []
    for t in range(steps_of(inputs)):
        carry, y = body(carry, tmap(lambda x: x[t], inputs))
        ys.append(y)
    return carry, tmap(lambda *col: torch.stack(col), *ys)


def dot(cot: Any, value: Any) -> torch.Tensor:
    """sum of <cot, value> over tensor leaves; a None cotangent is zero."""
    if cot is None or value is None:
        return torch.zeros((), dtype=torch.float64)
    if isinstance(value, torch.Tensor):
        return (cot.to(value.dtype) * value).sum().to(torch.float64)
    if isinstance(value, dict):
        return sum((dot(cot[k], value[k]) for k in value), torch.zeros((), dtype=torch.float64))
    return sum((dot(c, v) for c, v in zip(cot, value)), torch.zeros((), dtype=torch.float64))


def objective(body: Callable[..., Any], carry: Any, inputs: Any, cot_c: Any, cot_y: Any) -> torch.Tensor:
    final, ys = scan(body, carry, inputs)
    return dot(cot_c, final) + dot(cot_y, ys)


def autograd_grads(body, carry, inputs, cot_c, cot_y):
    carry = tmap(lambda x: x.clone().requires_grad_(True), carry)
    inputs = tmap(lambda x: x.clone().requires_grad_(True), inputs)
    loss = objective(body, carry, inputs, cot_c, cot_y)
    params = leaves(carry) + leaves(inputs)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
    it = iter(grads)
    return tmap(lambda _: next(it).detach(), carry), tmap(lambda _: next(it).detach(), inputs)


def fd_grads(body, carry, inputs, cot_c, cot_y, eps: float = 1e-6):
    """Central differences of the scalar objective, one element at a time."""

    def grad_of(tree: Any, rebuild: Callable[[Any], float]) -> Any:
        def leaf_grad(x: torch.Tensor) -> torch.Tensor:
            g = torch.zeros_like(x)
            flat, gflat = x.view(-1), g.view(-1)
            for i in range(flat.numel()):
                old = flat[i].item()
                flat[i] = old + eps
                up = rebuild(None)
                flat[i] = old - eps
                down = rebuild(None)
                flat[i] = old
                gflat[i] = (up - down) / (2 * eps)
            return g

        return tmap(leaf_grad, tree)

    def f(_: Any) -> float:
        with torch.no_grad():
            return float(objective(body, carry, inputs, cot_c, cot_y))

    return grad_of(carry, f), grad_of(inputs, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--body", required=True)
    ap.add_argument("--entry", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--fd", action="store_true")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("body_under_test", args.body)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    body = getattr(module, args.entry)
    with open(os.path.join(args.dir, "in.json")) as f:
        doc = json.load(f)
    carry = load_tree(doc["carry"], args.dir)
    inputs = load_tree(doc["inputs"], args.dir)
    out_dir = os.path.join(args.dir, "ref")
    os.makedirs(out_dir, exist_ok=True)
    result = {}
    with torch.no_grad():
        final, ys = scan(body, carry, inputs)
    result["carry"] = save_tree(final, out_dir, "carry", [0])
    result["outputs"] = save_tree(ys, out_dir, "outputs", [0])
    if args.grad:
        cot_c = load_tree(doc.get("cot_carry"), args.dir)
        cot_y = load_tree(doc.get("cot_outputs"), args.dir)
        gc, gi = autograd_grads(body, carry, inputs, cot_c, cot_y)
        result["grad_carry"] = save_tree(gc, out_dir, "grad_carry", [0])
        result["grad_inputs"] = save_tree(gi, out_dir, "grad_inputs", [0])
        if args.fd:
            fc, fi = fd_grads(body, carry, inputs, cot_c, cot_y)
            result["fd_carry"] = save_tree(fc, out_dir, "fd_carry", [0])
            result["fd_inputs"] = save_tree(fi, out_dir, "fd_inputs", [0])
    with open(os.path.join(out_dir, "tree.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()

"""The eager reference loop: jax.lax.scan's contract, written out in Python."""

import torch


def tree_map(fn, tree):
    if tree is None:
        return None
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, v) for v in tree)
    if isinstance(tree, list):
        return [tree_map(fn, v) for v in tree]
    return {k: tree_map(fn, v) for k, v in tree.items()}


def leaves(tree):
    out = []
    tree_map(out.append, tree)
    return out


def first_leaf(tree):
    return leaves(tree)[0]


def stack(ys):
    first = ys[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.stack(ys)
    if isinstance(first, tuple):
        return tuple(stack([y[i] for y in ys]) for i in range(len(first)))
    if isinstance(first, list):
        return [stack([y[i] for y in ys]) for i in range(len(first))]
    return {k: stack([y[k] for y in ys]) for k in first}


def scan(body, carry, inputs):
    steps = first_leaf(inputs).shape[0]
    ys = []
    for t in range(steps):
        carry, y = body(carry, tree_map(lambda a, t=t: a[t], inputs))
        ys.append(y)
    return carry, stack(ys)

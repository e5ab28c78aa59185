"""The eager reference loop: jax.lax.scan's contract, written out in Python."""

import torch
import torch.utils._pytree as pytree


# torch's pytree keeps None as a leaf; here None is an empty subtree (as in
# jax and the wire's trees).
def tree_map(fn, tree):
    return pytree.tree_map(lambda x: None if x is None else fn(x), tree)


def leaves(tree):
    return [x for x in pytree.tree_leaves(tree) if x is not None]


def first_leaf(tree):
    return leaves(tree)[0]


def stack(ys):
    return pytree.tree_map(lambda *s: None if s[0] is None else torch.stack(s), ys[0], *ys[1:])


def scan(body, carry, inputs):
    steps = first_leaf(inputs).shape[0]
    ys = []
    for t in range(steps):
        carry, y = body(carry, tree_map(lambda a, t=t: a[t], inputs))
        ys.append(y)
    return carry, stack(ys)

"""A GRU cell whose weights ride in the carry (so torch's scan op, strategy
"scan", can take them as well as the unrolled loop).

carry: (h, Wz, Wr, Wh, Uz, Ur, Uh) with h [batch, hidden], W* [hidden,
hidden], U* [input, hidden]; input: x_t [batch, input]; output: h.
"""

import torch


def cell(carry, x):
    h, wz, wr, wh, uz, ur, uh = carry
    z = torch.sigmoid(x @ uz + h @ wz)
    r = torch.sigmoid(x @ ur + h @ wr)
    candidate = torch.tanh(x @ uh + (r * h) @ wh)
    h = (1.0 - z) * h + z * candidate
    return (h, wz, wr, wh, uz, ur, uh), h

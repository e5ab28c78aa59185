"""A tanh RNN cell; weights are module-level constants captured by the graph.

carry: (h, None) -- the None rides along unchanged; input: x_t of shape
(batch, 3); output: h after the step.
"""

import torch

HIDDEN, INPUT = 8, 3
_g = torch.Generator().manual_seed(1234)
W = torch.randn(HIDDEN, HIDDEN, generator=_g, dtype=torch.float64) * 0.3
U = torch.randn(INPUT, HIDDEN, generator=_g, dtype=torch.float64) * 0.5
B = torch.randn(HIDDEN, generator=_g, dtype=torch.float64) * 0.1


def cell(carry, x):
    h, nothing = carry
    h = torch.tanh(h @ W.to(h.dtype) + x @ U.to(h.dtype) + B.to(h.dtype))
    return (h, nothing), h

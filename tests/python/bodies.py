"""Adapter bodies for the Python client's tests (module-level: the daemon imports this source)."""

import torch


def ema(carry, x):
    carry = 0.9 * carry + 0.1 * torch.sin(x)
    return carry, carry * carry


def rnn(carry, x):
    """carry (h, None), inputs {"f": tensor}; outputs a dict with a None leaf."""
    h, aux = carry
    h = torch.tanh(0.5 * h + x["f"])
    return (h, aux), {"y": h.sum(-1, keepdim=True), "skip": None, "h2": [h * 2.0]}



W16 = torch.linspace(-0.5, 0.5, 256, dtype=torch.float64).reshape(16, 16)


def mm_chain(carry, x):
    """A matmul a step (which the backward keeps rather than recomputes) and
    one number out: test_saved.py's reply over --max-frame."""
    h = torch.tanh(carry @ W16 + x)
    return h, h.sum()

"""A tanh RNN whose weights ride in the carry (h, W, U) instead of being
module constants: torch's scan op (strategy "scan") cannot lower captured
constants in torch 2.14, so strategy benchmarks use this form for both."""

import torch


def cell(carry, x):
    h, w, u = carry
    h = torch.tanh(h @ w + x @ u)
    return (h, w, u), h

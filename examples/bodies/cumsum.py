"""Cumulative sum: carry + x; the output is the new carry."""


def body(carry, x):
    carry = carry + x
    return carry, carry

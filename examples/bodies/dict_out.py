"""A body whose outputs are a dict holding a tensor and a None."""


def body(carry, x):
    carry = carry * 0.5 + x
    return carry, {"value": carry * 2.0, "nothing": None}

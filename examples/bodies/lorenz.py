"""One classical RK4 step of the Lorenz system per scan step.

carry: {"x", "y", "z"} tensors of one shape (a batch of trajectories);
input: {"forcing": f} with f added to dx/dt at this step; output: x after
the step.
"""

SIGMA, RHO, BETA, DT = 10.0, 28.0, 8.0 / 3.0, 0.01


def _f(x, y, z, forcing):
    return SIGMA * (y - x) + forcing, x * (RHO - z) - y, x * y - BETA * z


def rk4(carry, inputs):
    forcing = inputs["forcing"]
    x, y, z = carry["x"], carry["y"], carry["z"]
    k1 = _f(x, y, z, forcing)
    k2 = _f(*(v + 0.5 * DT * k for v, k in zip((x, y, z), k1)), forcing)
    k3 = _f(*(v + 0.5 * DT * k for v, k in zip((x, y, z), k2)), forcing)
    k4 = _f(*(v + DT * k for v, k in zip((x, y, z), k3)), forcing)
    x, y, z = (
        v + DT / 6.0 * (a + 2 * b + 2 * c + d)
        for v, a, b, c, d in zip((x, y, z), k1, k2, k3, k4)
    )
    return {"x": x, "y": y, "z": z}, x

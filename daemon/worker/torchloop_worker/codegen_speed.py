"""Inductor's C++ code generation without per-operation set-up it repeats
(torch 2.14).

Each operation a kernel's loop body emits goes through the CSE proxy
(`torch._inductor.codegen.common.CSEProxy._default`), which asks
`DtypePropagationOpsHandler()` for the result's dtype.  The class is a
singleton (`__new__` returns the one instance), but Python runs `__init__`
on every call: each operation rebuilt the handler's ~200 rules as partials,
listed `dir()` of the instance and diffed it against every op name.  For
the Lorenz RK4 step unrolled 64 times (112 032 operations emitted) that was
15.9 s of a 108.8 s compile under cProfile.  `install` runs the original
`__init__` once per process: the rules it sets are functions of torch's
static tables (`op_dtype_propagation_rules`, `pointwise_overrides_data`,
`boolean_ops()`), so the instance is the same after each later call.

Installed once per process by build.py; the worker's cache key covers this
file.  TORCHLOOP_CODEGEN_SPEED=0 leaves Inductor as it is (for
before/after measurements).
"""

from __future__ import annotations

import os

ON = os.environ.get("TORCHLOOP_CODEGEN_SPEED", "1") != "0"


def install() -> None:
    """DtypePropagationOpsHandler's __init__ once per process (when ON)."""
    from torch._inductor.dtype_propagation import DtypePropagationOpsHandler

    orig = DtypePropagationOpsHandler.__init__
    if not ON or getattr(orig, "torchloop_once", False):
        return

    def init(self: DtypePropagationOpsHandler) -> None:
        if not getattr(self, "_torchloop_ready", False):
            orig(self)
            setattr(self, "_torchloop_ready", True)

    init.torchloop_once = True  # type: ignore[attr-defined]
    DtypePropagationOpsHandler.__init__ = init  # type: ignore[method-assign]

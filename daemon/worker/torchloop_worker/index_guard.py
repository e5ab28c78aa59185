"""Index checks in Inductor's C++ kernels that set a flag instead of throwing
(torch 2.14).

Inductor checks an index it reads from data (a gather, `C[idx]`, an
embedding) with `AOTI_TORCH_CHECK(0 <= i < size, ...)` inside the kernel's
loop, which runs in an OpenMP parallel region: the c10::Error it throws
there cannot leave the region, so libgomp calls std::terminate and takes the
daemon (the artifact's host process) with it.  `install` changes, for every
artifact the worker builds:

- the check (`CppKernel.check_bounds`, scalar and CppVecKernel code, masked
  and tail lanes as Inductor decides them) becomes `TORCHLOOP_INDEX_CHECK`,
  which sets bit FAULT_INDEX of the artifact's exported `int FAULT_SYMBOL`;
- the index variable is then made safe: a scalar out of range becomes 0, a
  vector's out-of-range lanes 0 (`v & in_range`), so no load or store
  touches memory outside the buffer on the run the daemon will refuse;
- `device_assert_async` (a `torch._assert_async` in the graph), which threw
  std::runtime_error in the same place, sets bit FAULT_ASSERT instead.

A kernel file that uses either gets PRELUDE (the flag, weak and exported,
and the macros); a graph without indexing has neither the symbol nor any
added code.  The daemon (daemon/base/engine.c) clears the flag before a run
of an artifact that exports it and fails the request when it is set after.
The scheme is part of every cache key (AOTI_OPTIONS in daemon/graph/graphs.h,
and the worker's hash covers this file): artifacts built before it, whose
checks throw, are never served.
"""

from __future__ import annotations

from typing import Any

FAULT_SYMBOL = "torchloop_index_fault"
FAULT_INDEX = 1
FAULT_ASSERT = 2
FAULT_LINALG = 4  # a linalg error check's info was nonzero (dispatch_calls.py)

PRELUDE = f"""#ifndef TORCHLOOP_INDEX_GUARD
#define TORCHLOOP_INDEX_GUARD
extern "C" {{
__attribute__((weak, visibility("default"))) int {FAULT_SYMBOL} = 0;
}}
#define TORCHLOOP_FAULT(bit) __atomic_fetch_or(&{FAULT_SYMBOL}, (bit), __ATOMIC_RELAXED)
#define TORCHLOOP_INDEX_CHECK(cond, msg) \\
    do {{ if (C10_UNLIKELY(!(cond))) TORCHLOOP_FAULT({FAULT_INDEX}); }} while (0)
#endif"""

INCLUDE = "#include <torch/csrc/inductor/cpp_prefix.h>"


def clamp_line(kernel: Any, var: Any, lower: bool, size: str) -> str:
    """C++ that makes var (a CSE variable, scalar or vector) an index in
    [0, size): out-of-range values (lanes) become 0."""
    name = str(var)
    if getattr(var, "is_vec", False):
        vec = kernel._get_vec_type(var.dtype)
        ok = f"({name} < {vec}({size}))"
        if lower:
            ok = f"(({vec}(0) <= {name}) & {ok})"
        return f"{name} = {name} & {ok};"
    ok = f"({name} < {size})"
    if lower:
        ok = f"(0 <= {name}) & {ok}"
    return f"if (C10_UNLIKELY(!({ok}))) {{ {name} = 0; }}"


def install() -> None:
    """Patches Inductor's C++ kernels once per process (see the module doc)."""
    import sympy
    from torch._inductor.codegen import cpp
    from torch._inductor.virtualized import V
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    from .errors import JobError

    kernel = cpp.CppKernel
    if getattr(kernel.check_bounds, "torchloop_guard", False):
        return
    orig_check = kernel.check_bounds
    orig_assert: Any = kernel.__dict__["assert_function"]  # a property
    orig_group = cpp.KernelGroup.codegen_group

    def assert_function(self: Any) -> str:
        if getattr(self, "_torchloop_guarding", False):
            return "TORCHLOOP_INDEX_CHECK"
        return str(orig_assert.fget(self))

    def check_bounds(self: Any, expr: sympy.Expr, size: sympy.Expr, lower: bool,
                     upper: bool) -> None:
        if not (lower or upper):
            return
        if size == 0:
            raise JobError("UNSUPPORTED_OP", "the graph indexes into an empty dimension")
        var = None
        if isinstance(expr, sympy.Symbol) and symbol_is_type(expr, SymT.TMP):
            var = self.cse.varname_map.get(expr.name)
        self._torchloop_guarding = True
        try:
            if var is None:  # an index of loop variables only: the same on every run
                orig_check(self, expr, size, lower, upper)
                return
            # an index read from data: checked and clamped before any load (a
            # vector kernel's gather copies it into an array at its first use)
            bound = V.kernel.sexpr(self.rename_indexing(size))
            line = self.indirect_assert(var, "0" if lower else None, bound if upper else None,
                                        self._load_mask)
        finally:
            self._torchloop_guarding = False
        self.compute.writeline(f"{line};")
        self.compute.writeline(clamp_line(self, var, lower, bound))

    def device_assert_async(self: Any, cond: str, msg: str) -> None:
        self.compute.writeline(f"if (C10_UNLIKELY(!({cond}))) TORCHLOOP_FAULT({FAULT_ASSERT});")

    def codegen_group(self: Any, name: str | None = None) -> str:
        code = str(orig_group(self, name))
        if "TORCHLOOP_" in code and INCLUDE in code:
            code = code.replace(INCLUDE, f"{INCLUDE}\n{PRELUDE}", 1)
        return code

    check_bounds.torchloop_guard = True  # type: ignore[attr-defined]
    setattr(kernel, "assert_function", property(assert_function))
    setattr(kernel, "check_bounds", check_bounds)
    setattr(kernel, "device_assert_async", device_assert_async)
    setattr(cpp.KernelGroup, "codegen_group", codegen_group)

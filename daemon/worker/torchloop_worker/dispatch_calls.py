"""Ops without a C shim, called through libtorch's stable C ABI (torch 2.14).

AOTInductor calls an ATen op that has no C shim in torch's CPU list
(torchgen's inductor_fallback_ops: `_linalg_solve_ex`, `linalg_lu_factor_ex`,
`linalg_lu_solve`, `linalg_solve_triangular`, `linalg_cholesky_ex`,
`linalg_inv_ex`, `_linalg_det`) through its C++ proxy executor, an object
the host process must construct from libtorch's C++ API and hand to every
run: the daemon, a C program, has none (elf.py refuses such an artifact with
PROXY_EXECUTOR_REQUIRED).  `install` makes the AOT wrapper call these ops as
Inductor's own cpp_wrapper JIT mode does: `aoti_torch_call_dispatcher(op,
overload, StableIValue*)`, declared in torch/csrc/inductor/aoti_torch/c/shim.h,
the ATen dispatcher by name from C, with arguments boxed as StableIValues
(torch/csrc/stable/stableivalue_conversions.h, header only).  The artifact
then imports only C symbols libtorch exports, loads in the daemon, in the
worker's parity check and in a solver's process alike, and needs no library
of ours.

Only the ops of DISPATCHED go this way, and only when every argument and
result is a StableIValue type (tensors, ints, floats, bools, optionals of
them: Inductor's own test); any other op without a C shim still goes to the
proxy executor, and the artifact is refused naming it.  An error the op
raises (a shape the kernel refuses) comes back as AOTI_TORCH_FAILURE from
the wrapper thread -- never from inside an OpenMP region -- and fails the
run: the engine's ENGINE_ERROR.

`_linalg_check_errors(info, api, is_matrix=)`, the check torch.export and
make_fx put beside a solve (wrapped in `with_effects`), takes a string: it
has no dispatcher path, and raising from it would lose what it says.  In an
AOT wrapper it becomes check_lines: a nonzero info sets FAULT_LINALG of the
artifact's fault flag (index_guard.py), and the daemon fails the run with
LINALG_ERROR.  (A captured graph ships no check: the package returns each
check's info and raises eager's error itself; its VJPs, which solve again,
keep theirs.)  No cache key changes with this module: before it, an artifact
calling these ops was refused, never cached.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .graph_schema import ALLOWED
from .index_guard import FAULT_LINALG, PRELUDE

# What goes through aoti_torch_call_dispatcher: the linear algebra a captured
# graph may call (graph_schema.ALLOWED), and what their derivatives call.
DISPATCHED = frozenset(ALLOWED["linear algebra"]) | {"_linalg_svd"}  # det's backward

HEADER = "torch/csrc/stable/stableivalue_conversions.h"
CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default

_installed: list[bool] = []


def check_lines(info: str) -> list[str]:
    """C++ of `_linalg_check_errors(info, ...)` in an AOT wrapper: any
    nonzero element of the int32 info tensor sets FAULT_LINALG of the
    artifact's fault flag (index_guard.py's PRELUDE), which the daemon's
    engine reads after the run: LINALG_ERROR."""
    return ["{",
            f"    AtenTensorHandle info_ = {info};",
            "    int64_t n_ = 0;",
            "    void *p_ = nullptr;",
            "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_numel(info_, &n_));",
            "    AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(info_, &p_));",
            "    for (int64_t i_ = 0; i_ < n_; i_++)",
            "        if (static_cast<const int32_t *>(p_)[i_] != 0) {",
            f"            TORCHLOOP_FAULT({FAULT_LINALG});",
            "            break;",
            "        }",
            "}"]


# the argument types a StableIValue carries (Inductor's
# CppWrapperCpu._compatible_with_stableivalue; dtypes, layouts and memory
# formats are IntType to a schema's `type`)
_BOXED = (torch.BoolType, torch.DeviceObjType, torch.FloatType, torch.IntType, torch.TensorType)


def _boxable(arg: torch.Argument, none: bool) -> bool:
    """Whether an argument crosses as a StableIValue: a type Inductor boxes
    (not symbolic), an optional of one, or an optional of any type whose
    value is None here (none): its StableIValue is the empty optional,
    whatever the element type."""
    t, real = arg.type, arg.real_type
    if isinstance(t, torch.OptionalType):
        if none:
            return True
        t, real = t.getElementType(), real.getElementType()
    return isinstance(t, _BOXED) and not isinstance(real, (torch.SymIntType, torch.SymBoolType))


def dispatched(op: object, args: list[str] | None = None) -> bool:
    """Whether op is called through the dispatcher in an AOT wrapper; args:
    the call's C++ argument strings (an optional given as None is
    "nullptr"), when known."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return False
    schema = op._schema
    if schema.name.removeprefix("aten::") not in DISPATCHED:
        return False
    given = list(args) if args is not None else []
    return all(_boxable(a, i < len(given) and given[i] == "nullptr")
               for i, a in enumerate(schema.arguments)) and \
        all(_boxable(r, False) for r in schema.returns)


def _drop_extern_node(buf_name: str) -> None:
    """FallbackKernel.codegen listed the op for the proxy executor (the
    <key>.wrapper.json elf.py reads) just before the call: not called so."""
    from torch._inductor.virtualized import V

    nodes = V.extern_kernel_nodes
    if nodes and nodes[-1].name == buf_name:
        nodes.pop()


def install() -> None:
    """Patches the C++ wrapper's fallback call for AOT builds (once)."""
    if _installed:
        return
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.virtualized import V

    runtime_lookup: Callable[..., None] = CppWrapperCpu.generate_fallback_kernel_with_runtime_lookup

    def lookup(self: CppWrapperCpu, buf_name: str, python_kernel_name: str,
               get_args: Callable[[], Sequence[str]], op_overload: object,
               raw_args: Sequence[object], outputs: Sequence[object]) -> None:
        args = list(get_args()) if V.graph.aot_mode else None
        if V.graph.aot_mode and op_overload is CHECK_ERRORS and args:
            _drop_extern_node(buf_name)
            if not getattr(self, "_torchloop_prelude", False):
                self.header.splice(PRELUDE)  # the fault flag, weak and exported
                setattr(self, "_torchloop_prelude", True)
            self.writelines(check_lines(args[0]))
            return None
        if not (V.graph.aot_mode and dispatched(op_overload, args)):
            return runtime_lookup(self, buf_name, python_kernel_name, get_args, op_overload,
                                  raw_args, outputs)
        _drop_extern_node(buf_name)
        # the JIT wrapper's path (generate_fallback_kernel_with_runtime_lookup_nopython)
        # (which takes an optional given as None whatever its element type:
        # dispatched() checked the rest, so its own check is answered here)
        self.include_extra_header(HEADER)
        V.graph.aot_mode = False
        setattr(self, "_compatible_with_stableivalue", lambda op: True)
        try:
            return runtime_lookup(self, buf_name, python_kernel_name, get_args, op_overload,
                                  raw_args, outputs)
        finally:
            V.graph.aot_mode = True
            del self._compatible_with_stableivalue

    setattr(CppWrapperCpu, "generate_fallback_kernel_with_runtime_lookup", lookup)
    _installed.append(True)

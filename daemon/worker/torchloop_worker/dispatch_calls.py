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
run: the engine's ENGINE_ERROR.  No cache key changes with it: before it,
an artifact calling these ops was refused, never cached.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .graph_schema import ALLOWED

# What goes through aoti_torch_call_dispatcher: the linear algebra a captured
# graph may call (graph_schema.ALLOWED), and what their derivatives call.
DISPATCHED = frozenset(ALLOWED["linear algebra"]) | {"_linalg_svd"}  # det's backward

HEADER = "torch/csrc/stable/stableivalue_conversions.h"
CHECK_ERRORS = torch.ops.aten._linalg_check_errors.default

_installed: list[bool] = []


def drop_checks(module: torch.nn.Module) -> int:
    """Removes `aten._linalg_check_errors` calls from the graphs the worker
    derived (a VJP recomputing the forward's torch.linalg.solve: make_fx
    records the check with the solve); returns how many.  Its schema takes
    a string, so it has no dispatcher path, and the check is the forward's:
    a captured graph ships none (not in graph_schema.ALLOWED; the package
    returns each check's info from the forward scan and raises eager's
    LinAlgError itself), and the backward solves the matrices the forward
    solved."""
    dropped = 0
    for gm in module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is CHECK_ERRORS and not node.users:
                gm.graph.erase_node(node)
                dropped += 1
        if dropped:
            gm.recompile()
    return dropped


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
        if not (V.graph.aot_mode and dispatched(op_overload, args)):
            return runtime_lookup(self, buf_name, python_kernel_name, get_args, op_overload,
                                  raw_args, outputs)
        # FallbackKernel.codegen listed it for the proxy executor (the
        # <key>.wrapper.json elf.py reads) just before this call: not called so
        nodes = V.extern_kernel_nodes
        if nodes and nodes[-1].name == buf_name:
            nodes.pop()
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

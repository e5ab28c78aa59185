"""AOTInductor builds: the options every artifact is built with, the
changes that let the daemon unload what it loads, and the build itself
(with the stacked results placed into the result buffers, stack_into.py,
or copied in when that fails)."""

from __future__ import annotations

import os
from typing import Callable, cast

import torch

from . import aoti_split, codegen_speed, dispatch_calls, index_guard, wrapper_pass
from .elf import clear_exec_stack, set_exec_stack
from .errors import JobError, classify
from .frames import log
from .stack_into import StackIntoOutputs

# a build: (artifact file name, the post-grad pass or None) -> the .so's path
Build = Callable[[str, StackIntoOutputs | None], str]

# TORCHLOOP_TEST_EXEC_STACK=1 (tests only: e2e test_codes.c): every artifact
# is marked as needing an executable stack after the build, so that the
# artifact check (elf.py) refuses it with UNSAFE_ARTIFACT
TEST_EXEC_STACK = "TORCHLOOP_TEST_EXEC_STACK"

# TORCHLOOP_AOTI_SPLIT=0: every wrapper built whole, the AOTI interface in
# it, as torch builds it (aoti_split.py; docs/operations.md)
SPLIT = os.environ.get("TORCHLOOP_AOTI_SPLIT", "1") != "0"

# TORCHLOOP_WRAPPER_PASS=0: the wrapper as Inductor generates it, without
# wrapper_pass.py's two changes (for before/after measurements)
WRAPPER_PASS = os.environ.get("TORCHLOOP_WRAPPER_PASS", "1") != "0"


def aoti_options(out_path: str, batched: bool = False) -> dict[str, object]:
    """Inductor options for every artifact; part of the daemon's cache key.

    use_consts_asm_build=False: the assembly route (weights.S) has no
    .note.GNU-stack section, so the linker marks the whole .so as needing an
    executable stack -- dlopen would then make every thread stack of the
    daemon executable (and newer glibc refuses such a library outright).

    check_lowerbound=False for a symbolic batch: Inductor assumes sizes >= 2
    of a symbol (torch's 0/1 specialization) and its input checks (on in the
    daemon) would refuse batch size 1; the daemon checks the batch (>= 1)
    itself, and the parity check runs every such graph at batch size 1.

    max_autotune off: its C++ GEMM templates hold checks that throw
    (index_guard.py covers the kernels Inductor generates otherwise).
    """
    options: dict[str, object] = {
        "aot_inductor.output_path": out_path,
        "aot_inductor.use_consts_asm_build": False,
        "aot_inductor.package_constants_in_so": True,
        "max_autotune": False,
        "max_autotune_gemm": False,
    }
    if batched:
        options["aot_inductor.check_lowerbound"] = False
    return options


# AOTI's interface keeps the last error in a thread_local std::string, which
# every entry point touches: each thread that calls into an artifact registers
# its destructor (__cxa_thread_atexit), and glibc keeps the library mapped
# until that thread exits -- the daemon's threads never do.  The same text with
# a trivially destructible buffer registers nothing.
LAST_ERROR_DECL = "static thread_local std::string g_aoti_last_error;"
LAST_ERROR_BUFFER = """#include <cstdio>
struct TorchloopLastError {  // torchloop: no thread-exit destructor (unloadable)
  char text[1024];
  void clear() { text[0] = '\\0'; }
  TorchloopLastError& operator=(const char* s) {
    std::snprintf(text, sizeof text, "%s", s);
    return *this;
  }
  const char* c_str() const { return text; }
};
static thread_local TorchloopLastError g_aoti_last_error;"""


def unloadable_artifacts() -> None:
    """Builds every artifact so that the daemon's dlclose unmaps it (once per
    process); check_artifact refuses one that would stay mapped.

    - g++ gives the static locals of inline functions (AOTI's runtime has a
      few dozen: log guards, regex tables) STB_GNU_UNIQUE binding, and glibc
      never unloads a library that defines one: -fno-gnu-unique makes them
      ordinary weak symbols, private to each artifact (loaded RTLD_LOCAL).
    - the interface's last-error string: LAST_ERROR_BUFFER instead.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import cpp_builder
    from torch._inductor.codegen import cpp_wrapper_cpu

    orig = cpp_builder._get_optimization_cflags
    if getattr(orig, "torchloop_unloadable", False):
        return

    def cflags(cpp_compiler: str, min_optimize: bool = False) -> tuple[list[str], list[str]]:
        c, ld = orig(cpp_compiler, min_optimize)
        return ([*c, "fno-gnu-unique"] if cpp_builder._is_gcc(cpp_compiler) else c), ld

    with open(os.path.join(os.path.dirname(cpp_wrapper_cpu.__file__), "aoti_runtime",
                           "interface.cpp")) as f:
        interface = f.read()
    # None: another torch, whose artifacts check_artifact refuses
    patched = interface.replace(LAST_ERROR_DECL, LAST_ERROR_BUFFER) \
        if LAST_ERROR_DECL in interface else None
    wrapper = cpp_wrapper_cpu.CppWrapperCpu
    orig_header = wrapper._write_aoti_interface_header

    def header(self: cpp_wrapper_cpu.CppWrapperCpu) -> None:
        if not inductor_config.aot_inductor.dynamic_linkage or patched is None:
            return orig_header(self)
        self.header.splice_aot(aoti_split.split_decl(patched) if SPLIT else patched)
        self.header.splice_aot("\n")
        return None

    orig_build = cpp_builder.CppBuilder.build

    def build(self: cpp_builder.CppBuilder) -> None:
        target = self.get_target_file_path()
        if not target.endswith(".wrapper.o") or patched is None:
            if not target.endswith(".o"):  # the link: the wrapper's object first
                aoti_split.PENDING.wait()
            return orig_build(self)
        cmd = self.get_command_line()
        aoti_split.PENDING.start(
            lambda: aoti_split.build_wrapper(lambda: orig_build(self), cmd, target, patched))
        return None

    cflags.torchloop_unloadable = True  # type: ignore[attr-defined]
    cpp_builder._get_optimization_cflags = cflags
    if WRAPPER_PASS:
        wrapper_pass.install(log)
    setattr(wrapper, "_write_aoti_interface_header", header)
    if SPLIT:
        setattr(cpp_builder.CppBuilder, "build", build)


def build_artifact(module: torch.nn.Module, example: tuple[torch.Tensor, ...], so_path: str,
                   batched: bool = False, placer: StackIntoOutputs | None = None) -> str:
    """AOT-compiles module into so_path (with placer as the post-grad pass
    when given); returns the .so's path."""
    unloadable_artifacts()
    codegen_speed.install()
    index_guard.install()  # no throw inside an OpenMP region (index_guard.py)
    dispatch_calls.install()  # ops without a C shim: no proxy executor (dispatch_calls.py)
    options = aoti_options(so_path, batched)
    if placer is not None:
        options["post_grad_custom_post_pass"] = placer
    try:
        so = torch._inductor.aot_compile(cast(torch.fx.GraphModule, module), example,
                                         options=options)
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - classified below
        raise classify(exc, "inductor") from exc
    finally:  # a wrapper build that outlived a failure before the link
        aoti_split.PENDING.drain()
    built = so if isinstance(so, str) else so_path
    if clear_exec_stack(built):
        log(f"{built}: cleared the executable-stack flag ld set")
    if os.environ.get(TEST_EXEC_STACK) == "1":  # a test's hook: check_artifact must refuse it
        set_exec_stack(built, True)
    return built


def build_placed(build: Build, notes: list[str]) -> str:
    """build(name, placer) with StackIntoOutputs and wrapper_pass.py's
    rewrite; both are optimisations, so if a graph either changed fails to
    build or to match eager, builds it again as Inductor would and says so in
    notes.  A failure of the machine (transient) is not retried, nor an
    artifact refused for how it was linked (neither changes the link)."""
    placer = StackIntoOutputs()
    wrapper_pass.STATE.changed = 0
    try:
        return build("graph.so", placer)
    except JobError as exc:
        changed = placer.rewritten or wrapper_pass.STATE.changed
        if not changed or exc.transient or exc.code == "UNSAFE_ARTIFACT":
            raise
        notes.append(f"a graph built with its stacked results placed into the result buffers "
                     f"and its wrapper rewritten failed ({exc.code}: {exc.message[:160]}); "
                     f"compiled as Inductor generates it instead")
        log(notes[-1])
    with wrapper_pass.off():
        return build("graph-copied.so", None)

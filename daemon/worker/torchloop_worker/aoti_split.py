"""The AOTI runtime's interface compiled once, not once per artifact.

Every AOTInductor wrapper.cpp begins with the runtime's C interface
(aoti_runtime/interface.cpp: some 40 extern "C" functions over the model
container) and so instantiates AOTInductorModelBase<AOTInductorModel>, the
same code for every graph; only the model's constructor and run_impl are the
graph's own.  g++ spent 4.3 s on a small graph's whole wrapper here, 1.9 s on
its own part; the artifact's whole build (wrapper, kernels, link) went from
5.2 to 2.8 s (tests/python/test_aoti_split.py's graph, the interface built).

build.py's header hook writes SPLIT_DECL where torch splices the interface:
the interface's #includes and an `extern template` of the base, so the
graph's translation unit instantiates none of it.  The interface (with
build.py's last-error change) and the base's explicit instantiation are
compiled once per wrapper command line (flags, ISA, precompiled header,
torch) into an object under Inductor's cache directory, and merged into each
wrapper object with a relocatable link (`g++ -r`); AOTI then links the
artifact as it would.  If that object cannot be built or merged, the wrapper
is built whole, with the interface in it, as torch builds it.

The wrapper's build (and the interface's, the first time) runs in a thread
of its own while AOTI goes on to compile the kernels, the two compilers on
two cores; the link waits for it (PENDING).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import threading
from typing import Callable

from .frames import log

MARKER = "// torchloop: AOTI interface prebuilt (aoti_split.py)"
BASE = "AOTInductorModelBase<AOTInductorModel>"
INSTANTIATE = f"\nnamespace torch::aot_inductor {{ template class {BASE}; }}\n"
DIR = "torchloop-aoti-interface"
FAILED: set[str] = set()  # objects that would not build in this process: not tried again


def split_decl(interface: str) -> str:
    """What the wrapper gets instead of the interface text."""
    includes = [line for line in interface.splitlines() if line.startswith("#include")]
    return "\n".join([MARKER, *includes,
                      f"namespace torch::aot_inductor {{ extern template class {BASE}; }}",
                      MARKER, ""])


def _cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), DIR)


def interface_object(cmd: str, source: str, target: str, prefix: str, interface: str) -> str:
    """The interface's object for this wrapper command (built if missing).
    prefix: the wrapper's text before the interface (its device header)."""
    text = prefix + interface + INSTANTIATE
    key = cmd.replace(source, "@SRC@").replace(target, "@OUT@")
    digest = hashlib.sha256(f"{key}\0{text}".encode()).hexdigest()[:32]
    path = os.path.join(_cache_dir(), f"{digest}.o")
    if os.path.exists(path):
        return path
    if digest in FAILED:
        raise OSError("it failed to build before in this worker")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stem = f"{path[:-2]}.{os.getpid()}"
    with open(f"{stem}.cpp", "w") as f:
        f.write(text)
    try:
        _run(shlex.split(cmd.replace(source, f"{stem}.cpp").replace(target, f"{stem}.o")))
        os.replace(f"{stem}.o", path)  # another worker may do the same: either wins
    except OSError:
        FAILED.add(digest)
        raise
    finally:
        for leftover in (f"{stem}.cpp", f"{stem}.o"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


def merge(cmd: str, target: str, obj: str) -> None:
    """target += obj (a relocatable link with the wrapper's compiler)."""
    merged = f"{target}.merged"
    _run([shlex.split(cmd)[0], "-r", "-nostdlib", "-o", merged, target, obj])
    os.replace(merged, target)


def _run(argv: list[str]) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise OSError(f"{os.path.basename(argv[0])} exited {res.returncode}: "
                      f"{(res.stderr or res.stdout).strip()[-400:]}")


def build_wrapper(build: Callable[[], None], cmd: str, target: str, interface: str) -> None:
    """build() (torch's CppBuilder.build of this wrapper object), split
    when the wrapper source has SPLIT_DECL in place of the interface."""
    source = f"{target[:-2]}.cpp"
    with open(source) as f:
        text = f.read()
    start = text.find(MARKER)
    end = text.find(MARKER, start + len(MARKER))
    if start < 0 or end < 0:  # not written by build.py's header hook
        build()
        return
    try:
        obj = interface_object(cmd, source, target, text[:start], interface)
    except OSError as exc:
        log(f"the AOTI interface object cannot be built ({exc}); building the wrapper whole")
        with open(source, "w") as f:
            f.write(text[:start] + interface + text[end + len(MARKER):])
        build()
        return
    build()
    try:
        merge(cmd, target, obj)
    except OSError:  # a damaged object in the cache: once more from source
        os.remove(obj)
        merge(cmd, target, interface_object(cmd, source, target, text[:start], interface))


class Pending:
    """Wrapper builds running while AOTI goes on; the link waits for them."""

    def __init__(self) -> None:
        self.jobs: list[tuple[threading.Thread, list[BaseException]]] = []

    def start(self, work: Callable[[], None]) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - raised by wait()
                errors.append(exc)

        thread = threading.Thread(target=run, name="aoti-wrapper", daemon=True)
        thread.start()
        self.jobs.append((thread, errors))

    def wait(self) -> None:
        """Waits for every build started; raises the first one's failure."""
        jobs, self.jobs = self.jobs, []
        failures = []
        for thread, errors in jobs:
            thread.join()
            failures.extend(errors)
        if failures:
            raise failures[0]

    def drain(self) -> None:
        """Waits for every build started, their failures dropped (the
        compile failed before its link: that failure is the one to report)."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 - see above
            pass


PENDING = Pending()

"""What Inductor generates code for on this machine, and which torch it is,
remembered across worker starts.

hello reports the target (Inductor's vector ISA and -march), which the
daemon puts in every cache key, and the daemon is ready only once a worker
said hello.  Finding the ISA imports Inductor and may compile a probe
program; importing torch alone takes about 2 s of CPU here.  The answer
(the ISA and torch's C++ ABI) is kept in a file under Inductor's cache
directory, keyed by everything it depends on: torch's build (its version
and git revision, read from torch/version.py without importing torch), the
interpreter, the environment that steers Inductor (ATEN_CPU_CAPABILITY,
TORCHINDUCTOR_CPP_MARCH, CXX), the compiler's file and the CPU's flags.  So
a worker on a machine that has the file answers hello without importing
torch at all (compile_worker.py imports it for the first job).  Anything
else -- no cache directory, a file that does not parse or was written for
another key -- imports torch and finds the target as before.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from typing import NamedTuple

FILE = "torchloop-target-isa.json"
ENV = ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH", "CXX")


class Torch(NamedTuple):
    """The torch this worker would import: its build and library directory."""
    version: str
    git: str
    lib: str


class Target(NamedTuple):
    isa: str  # "vec=...;march=..."
    cxx11_abi: bool


@functools.lru_cache(maxsize=1)
def torch_build() -> Torch:
    """torch's version and git revision from its version.py (the file torch
    itself imports: assignments of literals), without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch is not installed for this interpreter")
    root = list(spec.submodule_search_locations)[0]
    names: dict[str, object] = {}
    with open(os.path.join(root, "version.py")) as f:
        exec(compile(f.read(), f.name, "exec"), names)  # noqa: S102 - torch's own file
    return Torch(str(names["__version__"]), str(names.get("git_version", "")),
                 os.path.join(root, "lib"))


def find() -> Target:
    """The target, asked of Inductor (imports torch)."""
    import torch
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return Target(f"vec={isa if isa else 'none'};march={config.cpp.march or 'native'}",
                  bool(torch.compiled_with_cxx11_abi()))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def key() -> str:
    """A digest of what the target depends on."""
    cxx = shutil.which(os.environ.get("CXX", "g++")) or ""
    try:
        st = os.stat(cxx) if cxx else None
        compiler = f"{os.path.realpath(cxx)}:{st.st_size}:{st.st_mtime_ns}" if st else ""
    except OSError:
        compiler = ""
    build = torch_build()
    parts = [build.version, build.git, sys.executable,
             *(f"{k}={os.environ.get(k, '')}" for k in ENV), compiler, _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _kept(path: str, k: str) -> Target | None:
    try:
        with open(path) as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(kept, dict) and kept.get("key") == k and isinstance(kept.get("isa"), str) \
            and isinstance(kept.get("cxx11_abi"), bool):
        return Target(kept["isa"], kept["cxx11_abi"])
    return None


def target() -> Target:
    """find(), from the file when it was written for this key."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        return find()
    path, k = os.path.join(base, FILE), key()
    found = _kept(path, k)
    if found is not None:
        return found
    found = find()
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(base, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"key": k, "isa": found.isa, "cxx11_abi": found.cxx11_abi}, f)
        os.replace(tmp, path)
    except OSError:  # read-only or full: found again next time
        pass
    return found

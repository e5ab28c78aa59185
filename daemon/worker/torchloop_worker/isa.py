"""What Inductor generates code for on this machine, remembered across
worker starts.

hello reports the target (Inductor's vector ISA and -march), which the
daemon puts in every cache key, and the daemon is ready only once a worker
said hello.  Finding the ISA imports Inductor (about 1.4 s of a worker's
3.4 s start here) and may compile a probe program; every daemon start
paid it before its first request.  The answer is kept in a file under
Inductor's cache directory, keyed by everything it depends on: torch's
build, the interpreter, the environment that steers Inductor
(ATEN_CPU_CAPABILITY, TORCHINDUCTOR_CPP_MARCH, CXX), the compiler's file and
the CPU's flags.  Anything else -- no cache directory, a file that does not
parse or was written for another key -- finds the ISA as before.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import torch

FILE = "torchloop-target-isa.json"
ENV = ("ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH", "CXX")


def find() -> str:
    """The target, asked of Inductor."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return f"vec={isa if isa else 'none'};march={config.cpp.march or 'native'}"


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
    parts = [torch.__version__, getattr(torch.version, "git_version", ""), sys.executable,
             *(f"{k}={os.environ.get(k, '')}" for k in ENV), compiler, _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def target_isa() -> str:
    """find(), from the file when it was written for this key."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not base:
        return find()
    path, k = os.path.join(base, FILE), key()
    try:
        with open(path) as f:
            kept = json.load(f)
        if isinstance(kept, dict) and kept.get("key") == k and isinstance(kept.get("isa"), str):
            return kept["isa"]
    except (OSError, ValueError):
        pass
    isa = find()
    tmp = f"{path}.{os.getpid()}"
    try:
        os.makedirs(base, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump({"key": k, "isa": isa}, f)
        os.replace(tmp, path)
    except OSError:  # read-only or full: found again next time
        pass
    return isa

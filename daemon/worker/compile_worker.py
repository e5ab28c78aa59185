"""torchloopd compile worker: one long-lived Python process per daemon slot.

It speaks the daemon's framing (4-byte big-endian length + one msgpack map)
on stdin/stdout and never sees a client socket; stderr is its log.  The work
is done by the package beside it (torchloop_worker/__init__.py lists the
modules); this script answers hello, dispatches the ops and dies with the
daemon.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from typing import Any

# the package lives beside this file, however it was started
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchloop_worker import MIN_TORCH, PROTOCOL  # noqa: E402
from torchloop_worker.errors import JobError, classify  # noqa: E402
from torchloop_worker.frames import BadText, log, read_frame, write_frame  # noqa: E402
from torchloop_worker.isa import target, torch_build  # noqa: E402


def hello() -> dict[str, object]:
    """The worker's build and target; torch itself is imported only when
    the target was not kept (isa.py)."""
    build, found = torch_build(), target()
    version = tuple(int(p) for p in build.version.split("+")[0].split(".")[:2])
    return {
        "protocol": PROTOCOL,
        "torch": build.version,
        "torch_git": build.git,
        "cxx11_abi": found.cxx11_abi,
        "python": sys.version.split()[0],
        "torch_ok": version >= MIN_TORCH,
        "torch_lib": build.lib,
        "isa": found.isa,
        # the first job is preceded by a "ready" event, sent once the compile
        # path is imported (main): the job's compile timeout starts there
        "ready_event": True,
    }


# Each parity check loads an artifact (unloaded after it: unloadable_artifacts);
# after this many, the reply asks the daemon to replace this worker (between
# jobs), which bounds whatever else a long-lived worker accumulates.
RECYCLE_AFTER = max(1, int(os.environ.get("TORCHLOOP_WORKER_RECYCLE", "32") or 32))


def handle(req: dict[str, Any]) -> dict[str, Any]:
    reply = handle_op(req)
    parity = sys.modules.get("torchloop_worker.parity")  # loaded by the first job
    if parity is not None and parity.artifacts_loaded[0] >= RECYCLE_AFTER:
        reply["recycle"] = True
    return reply


def handle_op(req: dict[str, Any]) -> dict[str, Any]:
    op = req.get("op")
    rid = req.get("id")
    try:
        if op == "hello":
            return {"id": rid, "result": hello()}
        # torch.export, dynamo and Inductor: imported once hello is answered
        # (main), so the daemon is ready without waiting for them
        from torchloop_worker.compile import check_body, compile_job
        from torchloop_worker.job import Job

        keep_headers_shared()

        if op == "compile":
            return {"id": rid, "result": compile_job(Job.parse(req))}
        if op == "check":
            return {"id": rid, "result": check_body(Job.parse(req))}
        raise JobError("UNKNOWN_OP", f"worker has no op {op!r}")
    except JobError as exc:
        return exc.reply(rid)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a reply
        log(traceback.format_exc())
        return classify(exc, "inductor").reply(rid)


def keep_headers_shared() -> None:
    """Inductor keeps its precompiled headers (~150 MB, seconds to build)
    under tempfile.gettempdir(), which the sandbox makes this worker's
    scratch, removed with it: point them at Inductor's cache directory,
    which every worker may write and which outlives them."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base:
        # imported here, not found in sys.modules: the compile path has not
        # always imported it yet, and then every worker built its own headers
        # in its scratch (20-30 s more for its first compile)
        import torch._inductor.codecache as codecache

        headers = os.path.join(base, "precompiled_headers")
        setattr(codecache, "_HEADER_DIR", headers)
        setattr(codecache, "_HEADER_LOCK_DIR", os.path.join(headers, "locks"))


def import_compile_path() -> None:
    """Imports what jobs need (torch.export, dynamo, Inductor: seconds of
    CPU, far more on a busy machine).  An import that fails is the job's to
    report (handle_op imports again)."""
    try:
        import torchloop_worker.compile  # noqa: F401 - the jobs' imports, now
        log("compile path imported")
    except Exception:  # noqa: BLE001 - the job that needs it says why
        log(traceback.format_exc())


PR_SET_PDEATHSIG = 1


def die_with_daemon() -> None:
    """SIGKILL this worker when the daemon's spawning thread dies.

    The daemon passes its pid in TORCHLOOPD_PID; if it is already gone
    (we were reparented before prctl took effect), exit at once.
    """
    parent = os.environ.get("TORCHLOOPD_PID")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log(f"prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if parent and os.getppid() != int(parent):
        log("the daemon is gone; exiting")
        os._exit(3)


def main() -> int:
    die_with_daemon()
    # The parity check runs artifacts as the daemon does: with the generated
    # code's input checks on (read once per artifact, at its first run).
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    # Replies go to the real stdout; anything torch prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer

    probe = os.environ.get("TORCHLOOP_TEST_SANDBOX_PROBE")
    if probe:  # a test's hook (torchloop_worker/sandbox_probe.py), before any job
        from torchloop_worker.sandbox_probe import run as run_probe
        log(run_probe(probe))
    log(f"ready (torch {torch_build().version})")
    imported = ready = False
    preload = os.environ.get("TORCHLOOP_WORKER_PRELOAD", "1") != "0"
    while True:
        try:
            req = read_frame(stdin)
        except BadText as exc:  # well framed: this job fails, the worker serves on
            log(str(exc))
            write_frame(out, JobError("BAD_REQUEST", str(exc), exc.field).reply(exc.rid))
            continue
        except (EOFError, ValueError) as exc:
            log(f"bad frame from the daemon: {exc}")
            return 2
        if req is None:
            return 0
        hello = req.get("op") == "hello"
        if not hello and not ready:
            # the first job: the daemon runs its compile timeout from this
            # event, so the import (TORCHLOOP_WORKER_PRELOAD=0: now) never
            # counts against a compile; --worker-start-timeout bounds it
            if not imported:
                import_compile_path()
            imported = ready = True
            # id 0 (hello's), never a job's: a daemon that knows no such
            # event drops it as a reply to no job
            write_frame(out, {"id": 0, "event": "ready"})
        write_frame(out, handle(req))
        if hello and preload and not imported:  # the jobs' imports, now
            import_compile_path()
            imported = True


if __name__ == "__main__":
    sys.exit(main())

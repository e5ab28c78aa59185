"""Failures of a job as protocol errors (proto/protocol.h codes): JobError,
and classify, which maps what export or Inductor raised to a code."""

from __future__ import annotations

import errno


class GraphError(Exception):
    """The text is not a graph this worker will compile; path says where."""

    def __init__(self, message: str, path: str = "graph", code: str = "BAD_GRAPH") -> None:
        super().__init__(message)
        self.message, self.path, self.code = message, path, code


class JobError(Exception):
    """A compile failure with a protocol error code and a leaf path."""

    def __init__(self, code: str, message: str, path: str = "", transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.path = path
        # A failure of the machine, not of the body (disk full, I/O error, out of
        # memory): the daemon must not remember it against the specialization.
        self.transient = transient

    def reply(self, rid: object) -> dict[str, object]:
        err: dict[str, object] = {"code": self.code, "message": self.message, "path": self.path}
        if self.transient:
            err["transient"] = True
        return {"id": rid, "error": err}


def classify(exc: BaseException, phase: str) -> JobError:
    """Maps a failure of the export ("capture") or Inductor ("inductor") phase."""
    if isinstance(exc, JobError):
        return exc
    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and len(chain) < 8:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for e in chain:
        if isinstance(e, JobError):
            return e
        if isinstance(e, GraphError):
            return JobError(e.code, e.message, e.path)
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain)
    resource = resource_failure(chain, text)
    if resource is not None:
        return resource
    short = f"{type(exc).__name__}: {str(exc).strip()[:1500]}"
    if "Constraints violated" in text:  # only ever with a symbolic batch
        return JobError(
            "BATCH_SPECIALIZED",
            "dynamic = batch: the body fixes the batch size (it mixes the batch with a tensor "
            "or size of its own), so one graph cannot serve every batch size; register the "
            f"adapter without dynamic = batch to compile one graph per batch size. {short}",
        )
    data_dependent = (
        "data-dependent" in text.lower()
        or "GuardOnDataDependentSymNode" in text
        or "Dynamic control flow" in text
        or "generic_jump" in text
    )
    if data_dependent:
        return JobError(
            "GRAPH_BREAK",
            "the body cannot be captured as one static graph (data-dependent Python control "
            f"flow or shapes): {short}",
        )
    if phase == "capture":
        return JobError(
            "UNSUPPORTED_OP",
            f"the body ran eagerly but uses something torch.export cannot capture: {short}",
        )
    if any("Lowering" in type(e).__name__ or isinstance(e, NotImplementedError) for e in chain):
        return JobError("UNSUPPORTED_OP", f"Inductor cannot compile an op of the body: {short}")
    return JobError("COMPILE_FAILED", f"Inductor failed: {short}")


# errno values and the texts g++/ld print for them: a full disk or a failing
# device is the machine's fault, never the body's.
RESOURCE_ERRNOS = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EIO: "Input/output error",
    errno.ENOMEM: "Cannot allocate memory",
    errno.EMFILE: "Too many open files",
}


def resource_failure(chain: list[BaseException], text: str) -> JobError | None:
    """A transient COMPILE_FAILED whose message starts with the cause.

    The cause goes first because the daemon's messages are bounded and a
    compiler's output puts it last, after pages of command line.
    """
    cause = None
    for e in chain:
        if isinstance(e, OSError) and e.errno in RESOURCE_ERRNOS:
            cause = RESOURCE_ERRNOS[e.errno]
            break
        if isinstance(e, MemoryError):
            cause = RESOURCE_ERRNOS[errno.ENOMEM]
            break
    if cause is None:
        cause = next((t for t in RESOURCE_ERRNOS.values() if t in text), None)
    if cause is None:
        return None
    tail = text.strip().replace("\n", " ")[-600:]
    return JobError(
        "COMPILE_FAILED",
        f"{cause} while compiling (a resource problem of this machine; the next request "
        f"retries): ...{tail}",
        transient=True,
    )



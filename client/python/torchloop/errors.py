"""Exceptions carrying the daemon's error code, message and leaf path.

Codes that describe a bad value (bounds, lengths, shapes) raise a subclass
of ValueError and codes that describe a bad type (dtype, tree node kinds) a
subclass of TypeError, as the in-process reference adapter does; an index
the graph read from its inputs out of range (INDEX_OUT_OF_RANGE) an
IndexError that is also a RuntimeError, as eager torch raises one or the
other (`C[idx]`, index_select: IndexError; gather: RuntimeError); a singular
matrix a graph's linear solve met (LINALG_ERROR) a torch.linalg.LinAlgError;
everything else is a TorchloopError (a RuntimeError).  docs/protocol.md lists
the codes.
"""

from __future__ import annotations

import torch

VALUE_CODES = frozenset(
    {
        "INVALID_BOUNDS",
        "INVALID_NAME",
        "NO_INPUTS",
        "BAD_RANK",
        "LENGTH_MISMATCH",
        "BATCH_MISMATCH",
        "TOO_MANY_STEPS",
        "TOO_MANY_ELEMENTS",
        "SPEC_MISMATCH",
        "COTANGENT_MISMATCH",
        "SAVED_MISMATCH",
        "CARRY_MISMATCH",
        "BAD_SHAPE",
        "SHAPE_OVERFLOW",
        "DEPTH_EXCEEDED",
        "TOO_MANY_LEAVES",
        "KEY_TOO_LONG",
        "DUPLICATE_KEY",
        "BAD_REQUEST",  # request text that is not UTF-8 (as UnicodeError, a ValueError)
    }
)
TYPE_CODES = frozenset({"DTYPE_MISMATCH", "BAD_DTYPE", "UNKNOWN_TYPE", "NON_STRING_KEY"})
INDEX_CODES = frozenset({"INDEX_OUT_OF_RANGE"})
LINALG_CODES = frozenset({"LINALG_ERROR"})


class TorchloopError(RuntimeError):
    """A request the daemon (or the connection to it) failed."""

    def __init__(self, code: str, message: str, path: str = "") -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.code = code
        self.message = message
        self.path = path


class TorchloopValueError(TorchloopError, ValueError):
    """A bad value: bounds, lengths, shapes, element counts."""


class TorchloopTypeError(TorchloopError, TypeError):
    """A bad type: dtype, tree node kind, dict key type."""


class TorchloopIndexError(TorchloopError, IndexError):
    """An index the graph read from its inputs is out of range."""


class TorchloopLinAlgError(TorchloopError, torch.linalg.LinAlgError):
    """A linear solve of the graph met a singular (a Cholesky factorization:
    non-positive-definite) matrix: what eager torch raises there.  (A captured
    body's scan raises eager's own error, with eager's message: _checks.py.)"""


class ConnectionLost(TorchloopError, ConnectionError):
    """The daemon cannot be reached or closed the connection.

    unanswered: the connection broke before any byte of a reply frame
    arrived (a write failed, or the daemon closed between frames), so the
    request did not run or its result was never started; Client.call sends
    such a request again on a new connection."""

    unanswered = False


def unanswered(exc: ConnectionLost) -> ConnectionLost:
    exc.unanswered = True
    return exc


def from_reply(error: dict) -> TorchloopError:
    """The exception for a reply's {"code", "message", "path"} map."""
    code = str(error.get("code", "INTERNAL"))
    message = str(error.get("message", ""))
    path = str(error.get("path", "") or "")
    if code in VALUE_CODES:
        return TorchloopValueError(code, message, path)
    if code in TYPE_CODES:
        return TorchloopTypeError(code, message, path)
    if code in INDEX_CODES:
        return TorchloopIndexError(code, message, path)
    if code in LINALG_CODES:
        return TorchloopLinAlgError(code, message, path)
    return TorchloopError(code, message, path)

"""What dynamo traces in place of array_api_compat.array_namespace.

Traced as written, `array_namespace(x)` walks array_api_compat's class
checks (numpy, cupy, torch, dask, jax through sys.modules) and leaves about
70 guards behind, which every warm scan of an Array-API body checks again
(about 1 µs of a ~3 µs guard check).  For what solver bodies pass it, torch
tensors and Python scalars, its answer is known: array_api_compat.torch.
This polyfill (torch.compiler.substitute_in_graph) returns that and
anything else goes to array_namespace's own code, so every call answers as
array_namespace does; in eager mode nothing changes.  Registered once, on
the first capture, when array_api_compat is installed; a torch without the
API, or another registration for the same function, leaves dynamo as it is.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

_SCALARS = (int, float, complex, bool)  # exactly: a numpy scalar is not one of them
_registered = False


def _fallback_of(fn: types.FunctionType) -> Callable[..., Any]:
    """A copy of fn dynamo inlines as plain code (not the polyfilled object)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def register() -> bool:
    """Registers the polyfill (once); whether dynamo uses it."""
    global _registered
    if _registered:
        return True
    try:
        from array_api_compat.common import _helpers

        import array_api_compat.torch as compat_torch
    except ImportError:
        return False
    original = _helpers.array_namespace
    if not isinstance(original, types.FunctionType):
        return False
    fallback = _fallback_of(original)

    def array_namespace(*xs: Any, api_version: str | None = None,
                        use_compat: bool | None = None) -> Any:
        if api_version is None and (use_compat is None or use_compat is True):
            tensors = False
            for x in xs:
                if isinstance(x, torch.Tensor):
                    tensors = True
                elif not (x is None or type(x) in _SCALARS):
                    return fallback(*xs, api_version=api_version, use_compat=use_compat)
            if tensors:
                return compat_torch
        return fallback(*xs, api_version=api_version, use_compat=use_compat)

    try:
        torch.compiler.substitute_in_graph(original)(array_namespace)
    except (AttributeError, TypeError, ValueError):  # no such API, or taken already
        return False
    _registered = True
    return True

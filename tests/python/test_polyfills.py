"""torchloop/_polyfills.py: what dynamo traces for array_api_compat.array_namespace.

Every call answers as array_namespace does in eager mode (the namespace
object itself, or the same exception type), for what solver bodies pass
(tensors, Python scalars) and for what goes to array_namespace's own code
(use_compat=False, an api_version, a numpy scalar, an unsupported type);
and a traced body keeps none of array_api_compat's class-check guards.
Dynamo traces only (backend "eager"): no Inductor compile.
"""

from __future__ import annotations

from typing import Any, Callable

import array_api_compat
import numpy as np
import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from torchloop import _polyfills

X = torch.rand(3, dtype=torch.float64)

CASES: dict[str, Callable[[torch.Tensor], Any]] = {
    "tensor": lambda x: array_api_compat.array_namespace(x),
    "two tensors": lambda x: array_api_compat.array_namespace(x, x[0]),
    "tensor and scalars": lambda x: array_api_compat.array_namespace(1.0, x, None, 2, True, 1j),
    "use_compat=True": lambda x: array_api_compat.array_namespace(x, use_compat=True),
    "use_compat=False": lambda x: array_api_compat.array_namespace(x, use_compat=False),
    "get_namespace": lambda x: array_api_compat.get_namespace(x),
}
RAISES: dict[str, Callable[[torch.Tensor], Any]] = {
    "scalars only": lambda x: array_api_compat.array_namespace(1.0, 2),
    "numpy scalar": lambda x: array_api_compat.array_namespace(x, np.float64(1.0)),
    "a string": lambda x: array_api_compat.array_namespace(x, "a"),
    "bad api_version": lambda x: array_api_compat.array_namespace(x, api_version="1999.01"),
}


def traced(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)


@pytest.fixture(scope="module", autouse=True)
def registered() -> None:
    assert _polyfills.register(), "the polyfill did not register"


@pytest.mark.parametrize("name", CASES)
def test_the_namespace_is_array_namespaces(name: str) -> None:
    fn = CASES[name]

    def body(x: torch.Tensor) -> tuple[bool, bool, torch.Tensor]:
        xp = fn(x)
        return xp is array_api_compat.torch, xp is torch, x + 1

    assert traced(body)(X)[:2] == body(X)[:2]


@pytest.mark.parametrize("name", RAISES)
def test_the_same_error_as_array_namespace(name: str) -> None:
    """The eager error's type, or dynamo's own refusal to trace
    array_namespace's code (a numpy scalar's dtype): what the fallback, the
    original code, gets from dynamo with or without the polyfill."""
    fn = RAISES[name]
    with pytest.raises(Exception) as eager_error:
        fn(X)
    with pytest.raises(Exception) as traced_error:
        traced(lambda x: (fn(x), x + 1))(X)
    error = traced_error.value
    assert isinstance(error, (type(eager_error.value), torch._dynamo.exc.Unsupported)), \
        f"eager raised {eager_error.value!r}, traced {error!r}"
    if isinstance(error, torch._dynamo.exc.Unsupported):
        assert "array_api_compat/common/_helpers.py" in str(error), error


def test_a_traced_body_keeps_no_class_check_guards() -> None:
    def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xp = array_api_compat.array_namespace(c)
        return c + x, xp.sum(c * c)

    fn = traced(step)
    fn(X, X[0])
    guards = str(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)[0].guard_manager)
    assert "_issubclass_fast" not in guards and "_cls_to_namespace" not in guards, guards
    assert torch.equal(fn(X, X[0])[1], step(X, X[0])[1])


def test_registering_twice_is_harmless() -> None:
    assert _polyfills.register() and _polyfills.register()

"""A stand-in of op_engine.loop_ops, written from shared/reference/loop_ops.txt:
the namespace -> LoopAdapter registry a solver looks adapters up in."""

from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class LoopAdapter:
    scan: Callable[..., Any]
    checkpoint: Callable[..., Any] | None = None


_LOOP_ADAPTERS: dict[str, LoopAdapter] = {}


def register_loop_adapter(namespace: str, adapter: LoopAdapter) -> None:
    if not namespace:
        msg = "Loop adapter namespace must not be empty"
        raise ValueError(msg)
    if not isinstance(adapter, LoopAdapter):
        msg = "adapter must be a LoopAdapter"
        raise TypeError(msg)
    _LOOP_ADAPTERS[namespace] = adapter


def get_loop_adapter(namespace: object) -> LoopAdapter | None:
    return _LOOP_ADAPTERS.get(getattr(namespace, "__name__", ""))

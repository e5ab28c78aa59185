"""torchloop: the Python client of torchloopd.

    import torchloop
    adapter = torchloop.loop_adapter(max_steps=64)
    final, ys = adapter.scan(body, carry, inputs)   # body: any callable torch.compile traces

docs/python.md has the details; docs/protocol.md the wire format.
"""

from .adapter import LoopAdapter, loop_adapter
from .client import Client, default_socket
from .errors import (
    ConnectionLost,
    TorchloopError,
    TorchloopIndexError,
    TorchloopLinAlgError,
    TorchloopTypeError,
    TorchloopValueError,
)

__all__ = [
    "Client",
    "ConnectionLost",
    "LoopAdapter",
    "TorchloopError",
    "TorchloopIndexError",
    "TorchloopLinAlgError",
    "TorchloopTypeError",
    "TorchloopValueError",
    "default_socket",
    "loop_adapter",
]

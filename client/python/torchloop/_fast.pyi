# The C codec's interface (_fast.c), for type checkers.
from typing import Callable

import torch

from ._shm import Area as _Area

class Conn:
    """One request's round trip on a connected socket."""

    polled: int  # reads of a reply busy polling served

    def __init__(self, fd: int, timeout_ms: int, lost: type[BaseException],
                 busy_poll_us: int = ...) -> None: ...
    def call(self, id: int, op: str, fields: dict[str, object], limit: int,
             on_event: Callable[[dict[str, object]], None] | None,
             place: Callable[[torch.Tensor], int | None] | None = ...,
             shm_min: int = ..., area: _Area | None = ...
             ) -> dict[str, object] | tuple[dict[str, object]] | bytearray | None: ...
    def recv_body(self) -> bytearray: ...

def setup(tensor: type, float32: object, float64: object, strided: object,
          from_numpy: Callable[..., object], empty: Callable[..., object], ndarray: type,
          np_f32: object, np_f64: object) -> None: ...
def encode(id: int, op: str, fields: dict[str, object], limit: int) -> bytes | None: ...
def decode(body: bytearray) -> object | None: ...
def rows(xs: list[torch.Tensor], max_steps: int,
         row_of: dict[tuple[int, torch.Size, tuple[int, ...], torch.dtype], torch.Tensor],
         last: list[list[torch.Tensor]]) -> list[torch.Tensor] | None: ...

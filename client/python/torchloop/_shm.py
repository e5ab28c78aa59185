"""A connection's shared-memory region (docs/protocol.md "Shared memory").

A sealed memfd (F_SEAL_SHRINK | F_SEAL_SEAL, so nobody can truncate it under
the daemon) mapped here and passed to the daemon once with SCM_RIGHTS.
Blocks are 64-byte aligned, first fit, neighbours merged.

Result tensors the daemon writes into a request's output area are views of
the region (no copy).  The area is freed when the last tensor viewing it is
gone: every view holds the area's memoryview (torch.frombuffer keeps its
buffer alive), and a finalizer on that memoryview returns the block.  The
finalizer may run on any thread at any time, so it only queues the offset;
the allocator, which runs under the Client's lock, takes the queue.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import mmap
import os
import weakref
from typing import Any

import torch

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Region:
    def __init__(self, size: int) -> None:
        page = mmap.PAGESIZE
        size = (max(size, 1) + page - 1) // page * page
        fd = os.memfd_create("torchloop", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.size = size
        self._bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = self._bytes.data_ptr()
        self._free: list[list[int]] = [[0, size]]  # sorted [offset, length]
        self._used: dict[int, int] = {}
        self._freed: collections.deque[int] = collections.deque()

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # ---- the allocator (caller holds the Client's lock) -------------------

    def reclaim(self) -> None:
        """Returns the blocks whose last view died since the last call."""
        while self._freed:
            self.free(self._freed.popleft())

    def alloc(self, n: int) -> int | None:
        self.reclaim()
        n = _align(max(n, 1))
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = [off + n, length - n]
                self._used[off] = n
                return off
        return None

    def free(self, off: int) -> None:
        n = self._used.pop(off)
        i = 0
        while i < len(self._free) and self._free[i][0] < off:
            i += 1
        self._free.insert(i, [off, n])
        if i + 1 < len(self._free) and off + n == self._free[i + 1][0]:
            self._free[i][1] += self._free.pop(i + 1)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            self._free[i - 1][1] += self._free.pop(i)[1]

    def free_later(self, off: int) -> None:
        self._freed.append(off)

    def bytes_free(self) -> int:
        self.reclaim()
        return sum(length for _, length in self._free)

    # ---- tensors ------------------------------------------------------------

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The region offset of a contiguous tensor that lies in the region."""
        p = t.data_ptr()
        n = t.numel() * t.element_size()
        if p < self.base or p + n > self.base + self.size or not t.is_contiguous():
            return None
        off = p - self.base
        return off if off % ALIGN == 0 else None

    def put(self, off: int, t: torch.Tensor) -> None:
        """Copies t into the region at off, on this thread alone.

        A contiguous tensor's bytes are copied by memmove with the GIL
        released, never by torch's copy_: copy_ splits a large copy over the
        process's OpenMP team, whose workers then spin for a while on the
        cores the daemon's run needs: on 2 cores a scan of 16 MiB took
        3.9-7.9 ms that way, 2.0-2.7 ms this way (docs/performance.md, "The
        Python client's large scans")."""
        n = t.numel() * t.element_size()
        if n == 0:
            return
        if t.is_contiguous() and t.is_cpu and not t.is_conj() and not t.is_neg():
            ctypes.memmove(self.base + off, t.data_ptr(), n)
        else:
            self._bytes[off:off + n].view(t.dtype).view(t.shape).copy_(t)

    def area(self, off: int) -> "Area":
        return Area(self, off)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in the region, freed when the last view of it is gone."""
        numel = 1
        for d in shape:
            numel *= d
        n = numel * dtype.itemsize
        off = self.alloc(n)
        if off is None:
            return None
        a = Area(self, off)
        return a.tensor(off, dtype, tuple(shape), n)


class Area:
    """One allocated block whose tensors keep it alive."""

    def __init__(self, region: Region, off: int) -> None:
        self.region = region
        self.off = off
        self.size = region._used[off]
        self.view = memoryview(region.mm)[off:off + self.size]
        weakref.finalize(self.view, region.free_later, off)

    def tensor(self, off: int, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> Any:
        rel = off - self.off
        if rel < 0 or rel + nbytes > self.size:
            raise ValueError(f"reply names bytes [{off}, +{nbytes}) outside its output area")
        numel = nbytes // dtype.itemsize
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.view, dtype=dtype, count=numel, offset=rel).view(shape)

"""A connection's shared-memory region (docs/protocol.md "Shared memory").

A sealed memfd (F_SEAL_SHRINK | F_SEAL_SEAL, so nobody can truncate it under
the daemon) mapped here and passed to the daemon once with SCM_RIGHTS.
Blocks are 64-byte aligned, first fit, neighbours merged.

A tensor of the solver's own is copied into a block of the region for the
request that sends it; the block is kept for the next request that sends the
same tensor unchanged (the same object, data pointer, layout and version
counter: every in-place write through torch bumps the counter), which then
sends it without copying it again (`Staged`).

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
        self.staged = Staged(self, size // 2)

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
        while True:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = [off + n, length - n]
                    self._used[off] = n
                    return off
            if not self.staged.evict():  # kept copies give way to a request's blocks
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
            with torch.no_grad():  # t may require grad: the region records no history
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


class _Copy:
    """A tensor's copy in the region, and what must not have changed since."""

    __slots__ = ("ref", "ptr", "version", "layout", "off")

    def __init__(self, t: torch.Tensor, off: int) -> None:
        self.ref = weakref.ref(t)
        self.ptr = t.data_ptr()
        self.version = t._version
        self.layout = (t.dtype, t.shape, t.stride())
        self.off = off

    def holds(self, t: torch.Tensor) -> bool:
        return (self.ref() is t and self.ptr == t.data_ptr() and self.version == t._version
                and self.layout == (t.dtype, t.shape, t.stride()))


class Staged:
    """The solver's tensors copied into the region, kept for the requests
    that send them again unchanged (least recently sent first out, at most
    max_bytes and MAX_COPIES of them; a copy whose tensor is gone or changed
    is dropped at the next lookup).  Inference tensors have no version
    counter: they are copied every time.  Under the Client's lock."""

    MAX_COPIES = 16

    def __init__(self, region: Region, max_bytes: int) -> None:
        self.region = region
        self.max_bytes = max_bytes
        self.bytes = 0
        self.copies: collections.OrderedDict[int, _Copy] = collections.OrderedDict()
        self.pinned: set[int] = set()  # offsets the request being built sends
        self._later: list[int] = []  # pinned blocks dropped: freed once it is sent
        self.hits = 0

    def lookup(self, t: torch.Tensor) -> int | None:
        """The offset of t's copy, when t is unchanged since it was made."""
        c = self.copies.get(id(t))
        if c is None:
            return None
        if not c.holds(t):
            self._drop(id(t))
            return None
        self.copies.move_to_end(id(t))
        self.pinned.add(c.off)
        self.hits += 1
        return c.off

    def keep(self, t: torch.Tensor, off: int) -> bool:
        """Keeps the block at off as t's copy (False: the request frees it)."""
        n = self.region._used[off]
        if t.is_inference() or n > self.max_bytes:
            return False
        if id(t) in self.copies:
            self._drop(id(t))
        for key in [k for k, c in self.copies.items() if c.ref() is None]:
            self._drop(key)  # its tensor is gone: nobody can send it again
        while self.bytes + n > self.max_bytes or len(self.copies) >= self.MAX_COPIES:
            if not self.evict():
                return False
        self.copies[id(t)] = _Copy(t, off)
        self.pinned.add(off)
        self.bytes += n
        return True

    def evict(self) -> bool:
        """Frees the least recently sent copy that the request being built
        does not send; False when there is none."""
        key = next((k for k, c in self.copies.items() if c.off not in self.pinned), None)
        if key is None:
            return False
        self._drop(key)
        return True

    def _drop(self, key: int) -> None:
        c = self.copies.pop(key)
        self.bytes -= self.region._used[c.off]
        if c.off in self.pinned:  # the request being built sends it: not before it is done
            self._later.append(c.off)
        else:
            self.region.free(c.off)

    def done(self) -> None:
        """The request that pinned copies was sent and answered (or failed)."""
        self.pinned.clear()
        for off in self._later:
            self.region.free(off)
        self._later.clear()

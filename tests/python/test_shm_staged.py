"""Inputs staged in the shared region once: a tensor of the solver's that a
request sends again unchanged (same object, data pointer, layout and version
counter) is not copied into the region again (torchloop/_shm.py Staged).

The bookkeeping is checked on a region alone; then through the daemon, every
result against the eager loop (tests/python/eager.py) -- the same input sent
again, and changed in place between sends in each way torch records (an
in-place op, an indexed write, a resize), an inference tensor (no version
counter), and the client with the cache off seeing a write torch does not
record.

Compiles: none of its own (test_shm.py's scan of bodies.ema at carry [N],
T = 2, registered under the same name and definition).
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch

import eager
import torchloop
from test_shm import NAME, SOURCE, N, T, check_grads, data
from torchloop._shm import Region


@pytest.fixture()
def client(daemon: str) -> Iterator[torchloop.Client]:
    with torchloop.Client(daemon) as c:
        c.register(NAME, SOURCE, "ema", body_file="bodies.py", max_elements=T * N)
        yield c


def _puts(c: torchloop.Client, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Offsets the client copies tensors to from now on."""
    c.empty((1,))  # the region exists from here on
    region = c._region
    assert region is not None
    seen: list[int] = []
    put = region.put

    def counting(off: int, t: torch.Tensor) -> None:
        seen.append(off)
        put(off, t)

    monkeypatch.setattr(region, "put", counting)
    return seen


def _check(c: torchloop.Client, carry: torch.Tensor, xs: torch.Tensor) -> None:
    import bodies

    got_c, got_y = c.scan(NAME, carry, xs)
    want_c, want_y = eager.scan(bodies.ema, carry.clone(), xs.clone())
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-14)


def test_an_input_sent_again_unchanged_is_not_copied_again(client, monkeypatch) -> None:
    carry, xs = data(11)
    puts = _puts(client, monkeypatch)
    _check(client, carry, xs)
    assert len(puts) == 2  # carry and xs, copied once
    hits = client._region.staged.hits
    for _ in range(3):
        _check(client, carry, xs)
    assert len(puts) == 2, "an unchanged input was copied again"
    assert client._region.staged.hits == hits + 6


def _regrow(xs: torch.Tensor) -> None:
    """resize_: the storage grows (it moves, the rows kept) and shrinks back
    to the same shape, then a write torch does not record: only what the
    resizes recorded (version counter, data pointer) shows the change."""
    ptr = xs.data_ptr()
    xs.resize_(2 * T, N).resize_(T, N)
    assert xs.data_ptr() != ptr and xs.shape == (T, N)
    xs.numpy()[0, 0] = 42.0


@pytest.mark.parametrize("change", [
    lambda xs: xs.add_(0.5),
    lambda xs: xs.__setitem__((1, 7), -3.0),
    lambda xs: xs[0].mul_(2.0),  # through a view: the version counter is shared
    lambda xs: xs.copy_(torch.flip(xs, (1,))),
    _regrow,
], ids=["add_", "setitem", "view", "copy_", "resize_"])
def test_an_input_changed_in_place_is_copied_again(
        client, monkeypatch, change: Callable[[torch.Tensor], object]) -> None:
    carry, xs = data(12)
    puts = _puts(client, monkeypatch)
    _check(client, carry, xs)
    with torch.no_grad():  # no grad mode does not hide a write from the counter
        change(xs)
    _check(client, carry, xs)
    assert len(puts) == 3, "the changed input was sent stale"


def test_a_new_tensor_over_the_same_memory_is_copied(client, monkeypatch) -> None:
    carry, xs = data(13)
    puts = _puts(client, monkeypatch)
    _check(client, carry, xs)
    _check(client, carry, xs.view(T, N))  # another object: not the cached one
    _check(client, carry, xs[:, :].contiguous())
    assert len(puts) == 4


def test_inputs_requiring_grad_are_kept_too_and_their_gradients_match(daemon: str,
                                                                     monkeypatch) -> None:
    """The codec sends a detached tensor, new at every call: the copy is kept
    for the caller's own.  (Two of its tensors once got one block: the first
    detached tensor died mid-request and the second took its id.)"""
    import bodies

    adapter = torchloop.loop_adapter(max_steps=4, max_elements=T * N, socket=daemon)
    carry, xs = data(16)
    puts = _puts(adapter.scan.__self__.client, monkeypatch)  # its _Driver's client
    c1, x1 = carry.clone().requires_grad_(), xs.clone().requires_grad_()
    for k in range(2):
        c1.grad = x1.grad = None
        fc, ys = adapter.scan(bodies.ema, c1, x1)
        (fc.sum() + (ys * ys).sum()).backward()
        # the inputs once; each backward's two cotangents are new tensors
        assert len(puts) == 2 + 2 * (k + 1), f"call {k}: the inputs were copied again"
    check_grads(fc, c1, x1, carry, xs)


def test_an_inference_tensor_is_copied_every_time(client, monkeypatch) -> None:
    with torch.inference_mode():
        carry, xs = data(14)
    puts = _puts(client, monkeypatch)
    _check(client, carry, xs)
    _check(client, carry, xs)
    assert len(puts) == 4


def test_with_the_cache_off_a_write_torch_does_not_record_is_seen(daemon: str, monkeypatch) -> None:
    carry, xs = data(15)
    with torchloop.Client(daemon, stage_cache=False) as c:
        puts = _puts(c, monkeypatch)
        _check(c, carry, xs)
        xs.numpy()[0, 0] = 42.0  # no version bump: only a fresh copy sees it
        _check(c, carry, xs)
        assert len(puts) == 4 and c._region.staged.hits == 0


def test_kept_copies_give_way_and_none_a_request_sends_is_taken() -> None:
    region = Region(1 << 16)
    staged = region.staged
    staged.max_bytes = 3 * 4096
    ts = [torch.full((512,), float(i), dtype=torch.float64) for i in range(5)]  # 4 KiB each
    offs = []
    for t in ts[:3]:
        off = region.alloc(4096)
        assert off is not None
        region.put(off, t)
        assert staged.keep(t, off)
        offs.append(off)
    staged.done()  # the request that sent them
    assert [staged.lookup(t) for t in ts[:3]] == offs
    staged.done()
    off = region.alloc(4096)
    assert off is not None and staged.keep(ts[3], off)  # over max_bytes: the oldest goes
    assert staged.lookup(ts[0]) is None and staged.bytes == 3 * 4096
    staged.pinned = {staged.copies[id(t)].off for t in ts[1:4]}  # all sent by this request
    off = region.alloc(4096)
    assert off is not None and not staged.keep(ts[4], off), "a pinned copy was evicted"
    region.free(off)
    staged.done()
    free = region.bytes_free()
    big = region.alloc(free + 3 * 4096)  # the region is full: kept copies give way
    assert big is not None and not staged.copies
    region.free(big)
    off = region.alloc(4096)
    assert off is not None and staged.keep(ts[0], off)
    gone = torch.zeros(512, dtype=torch.float64)
    off = region.alloc(4096)
    assert off is not None and staged.keep(gone, off)
    del gone  # a copy whose tensor died is dropped before any other
    staged.done()
    off = region.alloc(4096)
    assert off is not None and staged.keep(ts[1], off)
    assert len(staged.copies) == 2 and staged.lookup(ts[0]) is not None


@pytest.mark.parametrize("env, arg, want", [(None, None, True), ("0", None, False),
                                            ("1", None, True), ("0", True, True),
                                            (None, False, False)])
def test_the_cache_is_on_unless_turned_off(monkeypatch, env: str | None, arg: bool | None,
                                           want: bool) -> None:
    if env is None:
        monkeypatch.delenv("TORCHLOOP_STAGE_CACHE", raising=False)
    else:
        monkeypatch.setenv("TORCHLOOP_STAGE_CACHE", env)
    assert torchloop.Client("/nonexistent.sock", stage_cache=arg).stage_cache is want


def test_a_copy_dropped_while_its_request_is_built_is_freed_after_it() -> None:
    region = Region(1 << 16)
    a = torch.ones(512, dtype=torch.float64)
    off = region.alloc(4096)
    assert off is not None and region.staged.keep(a, off)
    region.staged._drop(id(a))  # e.g. its id taken by a new tensor in the same request
    assert off in region._used, "a block the request sends was freed before it was sent"
    region.staged.done()
    assert off not in region._used

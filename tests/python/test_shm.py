"""Shared memory from Python: tensors over the threshold travel through the
connection's memfd region instead of the socket.  Results are compared with
the eager loop and eager autograd (tests/python/eager.py), never with the
daemon's own output; the region's bookkeeping (results are views of it,
freed when they die, fed back without a copy) is checked directly.

Compiles: the scan and the grad of bodies.ema at carry [N], T = 2.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import eager
import torchloop
from torchloop import _wire

N = 32768  # 256 KiB of float64: over the client's threshold
T = 2
NAME = "py.shm.ema"
SOURCE = (Path(__file__).resolve().parent / "bodies.py").read_text()


@pytest.fixture(scope="module")
def client(daemon: str):
    with torchloop.Client(daemon) as c:
        c.register(NAME, SOURCE, "ema", body_file="bodies.py", max_elements=T * N)
        yield c


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N, generator=g, dtype=torch.float64), torch.rand(T, N, generator=g,
                                                                        dtype=torch.float64)


def in_region(c: torchloop.Client, t: torch.Tensor) -> bool:
    return c._region is not None and c._region.offset_of(t) is not None


def test_large_tensors_go_through_the_region_and_match_eager(client) -> None:
    import bodies

    carry, xs = data(1)
    got_c, got_y = client.scan(NAME, carry, xs)
    want_c, want_y = eager.scan(bodies.ema, carry, xs)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-14)
    assert in_region(client, got_c) and in_region(client, got_y), "results are region views"
    st = client.stats()
    assert st["shm_regions"] >= 1 and st["shm_attaches"] >= 1


def test_results_fed_back_are_sent_in_place_and_areas_are_freed(client) -> None:
    import bodies

    carry, xs = data(2)
    client.empty((1,))  # the region exists from here on
    region = client._region
    assert region is not None
    gc.collect()
    while region.staged.evict():  # copies earlier tests' inputs left
        pass
    free_before = region.bytes_free()
    c, want = carry, carry
    for _ in range(3):  # a solver loop: each final carry is the next call's carry
        c, y = client.scan(NAME, c, xs)
        want, _ = eager.scan(bodies.ema, want, xs)
        assert in_region(client, c) and in_region(client, y)
    torch.testing.assert_close(c, want, rtol=1e-12, atol=1e-14)
    assert region.bytes_free() < free_before, "live results hold their areas"
    del c, y
    gc.collect()
    kept = region.staged.bytes  # carry's and xs's copies, kept for the next send
    assert kept == (T + 1) * N * 8  # (test_shm_staged.py)
    assert region.bytes_free() + kept == free_before, "areas of dead results come back"


def test_inputs_allocated_in_the_region_are_not_copied(client) -> None:
    import bodies

    carry, xs = data(3)
    rc, rx = client.empty(carry.shape), client.empty(xs.shape)
    assert in_region(client, rc) and in_region(client, rx)
    rc.copy_(carry)
    rx.copy_(xs)
    got_c, got_y = client.scan(NAME, rc, rx)
    want_c, want_y = eager.scan(bodies.ema, carry, xs)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rc, carry)  # the daemon never writes into inputs


def test_region_scans_go_through_the_c_codec_and_feed_back_in_place(client, monkeypatch) -> None:
    """With the C codec built (make setup requires it), a scan through the
    region never falls back to _wire.py: references out and in are C's."""
    import bodies

    assert _wire.fast is not None, "the C codec was not built"

    def no_wire(*args: object, **kwargs: object) -> dict:
        raise AssertionError("a region scan went through _wire.py")

    monkeypatch.setattr(client, "_roundtrip", no_wire)
    carry, xs = data(7)
    c, want = carry, carry
    for _ in range(2):  # the second scan sends the first's final carry in place
        c, y = client.scan(NAME, c, xs)
        want, want_y = eager.scan(bodies.ema, want, xs)
        assert in_region(client, c) and in_region(client, y)
        torch.testing.assert_close(y, want_y, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c, want, rtol=1e-12, atol=1e-14)


def test_backward_through_the_region_matches_eager_autograd(daemon: str) -> None:
    import bodies

    adapter = torchloop.loop_adapter(max_steps=4, max_elements=T * N, socket=daemon)
    carry, xs = data(4)
    c1, x1 = carry.clone().requires_grad_(), xs.clone().requires_grad_()
    fc, ys = adapter.scan(bodies.ema, c1, x1)
    (fc.sum() + (ys * ys).sum()).backward()
    check_grads(fc, c1, x1, carry, xs)


def check_grads(fc: torch.Tensor, c1: torch.Tensor, x1: torch.Tensor, carry: torch.Tensor,
                xs: torch.Tensor) -> None:
    """fc and the gradients of fc.sum() + (ys * ys).sum() in c1 and x1
    against eager autograd from carry and xs."""
    import bodies

    c2, x2 = carry.clone().requires_grad_(), xs.clone().requires_grad_()
    ec, eys = eager.scan(bodies.ema, c2, x2)
    (ec.sum() + (eys * eys).sum()).backward()
    torch.testing.assert_close(fc, ec, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(c1.grad, c2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)


def test_without_shared_memory_the_answer_is_the_same(daemon: str, client) -> None:
    import bodies

    carry, xs = data(5)
    with torchloop.Client(daemon, shm=0) as plain:
        got_c, got_y = plain.scan(NAME, carry, xs)
        assert plain._region is None
    want_c, want_y = eager.scan(bodies.ema, carry, xs)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-14)


def test_a_refused_region_falls_back_to_the_socket(daemon: str, client) -> None:
    import bodies

    carry, xs = data(6)
    with torchloop.Client(daemon, shm=2 << 30) as big:  # over the daemon's max-shm (1 GiB)
        got_c, _ = big.scan(NAME, carry, xs)
        assert big.shm_error is not None and big.shm_error.code == "SHM_TOO_LARGE"
        assert big._region is None
        got_c2, _ = big.scan(NAME, carry, xs)  # and it keeps working inline
    want_c, _ = eager.scan(bodies.ema, carry, xs)
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_c2, want_c, rtol=1e-12, atol=1e-14)


def test_a_reference_without_a_region_is_refused_with_its_code(daemon: str, client) -> None:
    carry, xs = data(7)
    with torchloop.Client(daemon, shm=0) as c:
        c._connect()
        with pytest.raises(torchloop.TorchloopError) as info:
            c._roundtrip("scan", {"adapter": NAME, "carry": carry, "inputs": xs},
                         place=lambda t: 0)
        assert info.value.code == "SHM_NOT_ATTACHED"
        assert c.health()["live"]  # the connection still serves


def test_region_put_copies_every_kind_of_tensor_byte_for_byte() -> None:
    """Region.put copies contiguous tensors by memmove (from data_ptr, so a
    view's storage offset counts) and the rest through torch; both must land
    the same bytes at the offset asked and leave the neighbours alone."""
    from torchloop._shm import Region

    region = Region(1 << 16)
    try:
        base = torch.arange(4 * 300, dtype=torch.float64).reshape(4, 300)
        cases = [
            torch.rand(300, dtype=torch.float64),  # contiguous
            base[1:3],  # contiguous, at a storage offset of 300 elements
            base.t()[5:9],  # not contiguous: torch's copy
            torch.rand(7, 3, dtype=torch.float32),
            torch.empty(0, dtype=torch.float64),  # nothing to copy
        ]
        bytes_ = torch.frombuffer(region.mm, dtype=torch.uint8)
        for t in cases:
            n = t.numel() * t.element_size()
            off = region.alloc(n + 128)
            assert off is not None
            bytes_[off:off + n + 128].fill_(0xAB)
            region.put(off + 64, t)
            got = bytes_[off + 64:off + 64 + n].view(t.dtype).view(t.shape)
            assert torch.equal(got, t), t.shape
            assert bool((bytes_[off:off + 64] == 0xAB).all()), "bytes before it untouched"
            assert bool((bytes_[off + 64 + n:off + n + 128] == 0xAB).all()), "bytes after it untouched"
            region.free(off)
        del bytes_, got
    finally:
        region.close_fd()


def test_views_and_transposed_inputs_through_the_region_match_eager(client) -> None:
    """Inputs that are views (a storage offset) or not contiguous at all are
    copied into the region right: the answer is eager's on the same values."""
    import bodies

    carry, xs = data(8)
    big = torch.cat([torch.full((1, N), 7.0, dtype=torch.float64), xs])  # [T + 1, N]
    view = big[1:]  # contiguous, storage offset N
    transposed = xs.t().contiguous().t()  # the same values, column-major
    assert view.storage_offset() == N and not transposed.is_contiguous()
    want_c, want_y = eager.scan(bodies.ema, carry, xs)
    for inputs in (view, transposed):
        got_c, got_y = client.scan(NAME, carry, inputs)
        torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got_y, want_y, rtol=1e-12, atol=1e-14)
        assert in_region(client, got_c)

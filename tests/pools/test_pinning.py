"""Background pinning of host pools: the ranges registered, which pages the allocator hands out
while chunks are pinned, the thread's end, and (CUDA only) bytes through a partly pinned pool.

A fake registrar stands in for ``cudaHostRegister``; the background work is stepped through
``HostPinner.pin_next_chunk`` or gated by a semaphore the test releases, never by sleeping.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.pools.host import HostPool
from kvtier.pools.host_arena import HostArena
from kvtier.pools.pinning import HostPinner, Region, lazy_zeros, no_registrations, plan_ranges
from kvtier.pools.spec import PoolSpec
from tests.factories import PS, WINDOW_SPECS

SPECS = [
    PoolSpec("kv", 2, (2, 1, 4), torch.float32),
    PoolSpec("idx", 2, (3,), torch.float16, kind="sidecar", tokens_per_row=2),
    PoolSpec("ssm", 1, (5,), torch.float32, kind="state"),
]
"""Per page: 256 + 24 + 20 bytes, so page ranges straddle registration blocks."""
ALIGN = 64


class FakeRegistrar:
    """Records ``register`` calls as ``(ptr, nbytes)``; calls from a thread other than the
    test's wait for a ``gate`` permit first (when one is given)."""

    def __init__(self, gate: threading.Semaphore | None = None, fail_at: int = -1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.gate = gate
        self.fail_at = fail_at

    def register(self, ptr: int, nbytes: int) -> None:
        if self.gate is not None and threading.current_thread() is not threading.main_thread():
            self.gate.acquire()
        if len(self.calls) == self.fail_at:
            raise ConfigError("pinning refused (test)")
        self.calls.append((ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self.unregistered.append(ptr)


def host_pool(layout: str, num_pages: int = 6, chunk_pages: int = 2, **kw: object) -> HostPool:
    page_bytes = sum(s.page_bytes(PS) for s in SPECS)
    kw.setdefault("registrar", FakeRegistrar())
    kw.setdefault("background", False)
    return HostPool(
        SPECS,
        num_pages,
        PS,
        layout,
        pin=True,
        chunk_bytes=chunk_pages * page_bytes,
        align=ALIGN,
        **kw,  # type: ignore[arg-type]
    )


def registered_bytes(calls: list[tuple[int, int]]) -> set[int]:
    """Every byte address registered; asserts no byte is registered twice."""
    out: set[int] = set()
    for ptr, n in calls:
        assert ptr % ALIGN == 0 and n % ALIGN == 0 and n > 0
        span = set(range(ptr, ptr + n))
        assert not out & span, "a byte registered twice"
        out |= span
    return out


def page_bytes_of(pool: HostPool, pages: range) -> set[int]:
    """Byte addresses of ``pages`` in every component buffer."""
    out: set[int] = set()
    for name, buf in pool.buffers.items():
        view = pool.page_bytes_view(name)  # [layers, pages, bytes]
        base, nb = buf.data_ptr(), view.shape[2] * view.element_size()
        for layer in range(view.shape[0]):
            for p in pages:
                start = view[layer, p].data_ptr()
                assert base <= start < base + buf.numel() * buf.element_size()
                out |= set(range(start, start + nb))
    return out


def check(pool: HostPool) -> None:
    a = pool.allocator
    pool.check_integrity()
    assert a.available + a.used + a.pending == a.num_pages == pool.logical_pages
    fake = pool.pinner._registrar  # type: ignore[union-attr]
    ready = pool.pinner.ready_items  # type: ignore[union-attr]
    assert page_bytes_of(pool, range(ready)) <= registered_bytes(fake.calls)


def ids(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else t.tolist()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_ranges_cover_every_byte_once(layout: str) -> None:
    pool = host_pool(layout, num_pages=7, chunk_pages=2)
    pinner = pool.pinner
    assert pinner is not None and pinner.bounds == [0, 2, 4, 6, 7]
    fake = pinner._registrar
    assert isinstance(fake, FakeRegistrar)
    steps = 0
    while True:
        check(pool)
        if not pinner.pin_next_chunk():
            break
        steps += 1
    assert steps == 3 and pinner.done
    every = page_bytes_of(pool, range(pool.num_pages))
    assert len(every) == pool.nbytes
    covered = registered_bytes(fake.calls)
    assert every <= covered
    # beyond the buffers only each buffer's own alignment tail, never another buffer's bytes
    ends = [
        (b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in pool.buffers.values()
    ]
    for x in covered - every:
        assert any(e <= x < -(-e // ALIGN) * ALIGN for _, e in ends)
    # layer_first needs a range per layer (and buffer) per chunk; page_first one per buffer
    per_chunk = [len(r) for r in pinner.ranges]
    assert max(per_chunk) <= (3 if layout == "page_first" else 5)


def test_plan_gives_a_shared_block_to_the_earliest_chunk() -> None:
    # 2 stripes of 3 items of 24 bytes, chunks [0, 2) and [2, 3), blocks of 64 bytes:
    # stripe 0 is bytes 0-71, stripe 1 72-143. Block 64-127 holds stripe 0's item 2
    # (chunk 1) and stripe 1's items 0-1 (chunk 0): chunk 0 takes it, and block 128-191
    # (stripe 1's item 2 alone) is chunk 1's.
    ranges = plan_ranges([Region(1024, 2, 24)], 3, [0, 2, 3], 64)
    assert ranges == [[(1024, 128)], [(1152, 64)]]


def test_pages_are_handed_out_as_their_chunks_are_pinned() -> None:
    pool = host_pool("page_first", num_pages=6, chunk_pages=2)
    a, pinner = pool.allocator, pool.pinner
    assert pinner is not None
    check(pool)
    assert (a.num_pages, a.available, a.pending, pool.pages_ready) == (6, 2, 4, 2)
    assert ids(a.alloc(2)) == [0, 1]
    assert a.alloc(1) is None  # refused like a full pool: nothing taken
    check(pool)
    assert (a.used, a.available) == (2, 0)
    assert pinner.pin_next_chunk()
    check(pool)
    assert ids(a.alloc(1)) == [2]
    a.free(torch.tensor([0]))
    check(pool)
    assert ids(a.alloc(2)) == [3, 0]
    assert a.alloc(1) is None
    with pytest.raises(Exception, match="not ready"):
        a.free(torch.tensor([5]))
    check(pool)
    assert pinner.pin_next_chunk()
    assert not pinner.pin_next_chunk()
    check(pool)
    assert ids(a.alloc(2)) == [4, 5]
    assert (a.pending, a.available, pool.pages_ready) == (0, 0, 6)
    check(pool)


def test_lanes_pin_everything_before_returning() -> None:
    pool = host_pool("layer_first", num_pages=6, chunk_pages=2, lanes=2)
    assert pool.pinner is not None and pool.pinner.done
    assert pool.allocator.pending == 0 and pool.allocator.available == 12
    check(pool)


def test_background_thread_publishes_ready_pages_and_is_joined() -> None:
    gate = threading.Semaphore(0)
    fake = FakeRegistrar(gate)
    pool = host_pool("layer_first", num_pages=6, chunk_pages=2, registrar=fake, background=True)
    pinner = pool.pinner
    assert pinner is not None
    thread = pinner._thread
    assert thread is not None and thread.is_alive()
    assert pinner.ready_items == 2 and pool.allocator.available == 2
    gate.release(len(pinner.ranges[1]))
    assert pinner.wait(4, timeout=30)
    check(pool)
    assert pool.allocator.available == 4
    assert ids(pool.allocator.alloc(4)) == [0, 1, 2, 3]
    gate.release(len(pinner.ranges[2]))
    pool.close()
    assert not thread.is_alive() and pinner._thread is None
    calls = len(fake.calls)
    check(pool)
    assert len(fake.calls) == calls and fake.unregistered == []  # pinned until garbage
    registered = [p for p, _ in fake.calls]
    del pool, pinner
    gc.collect()
    assert sorted(fake.unregistered) == sorted(registered)


def test_garbage_pool_stops_a_blocked_thread_only_after_it_returns() -> None:
    gate = threading.Semaphore(0)
    fake = FakeRegistrar(gate)
    pool = host_pool("page_first", num_pages=6, chunk_pages=2, registrar=fake, background=True)
    thread = pool.pinner._thread  # type: ignore[union-attr]
    assert thread is not None
    gate.release(1000)  # whatever the thread still registers, it may finish
    del pool
    gc.collect()
    assert not thread.is_alive()
    assert sorted(fake.unregistered) == sorted(p for p, _ in fake.calls)


def test_a_refused_first_chunk_raises_and_leaves_nothing_registered() -> None:
    fake = FakeRegistrar(fail_at=2)
    with pytest.raises(ConfigError, match="refused"):
        host_pool("layer_first", registrar=fake)
    assert sorted(fake.unregistered) == sorted(p for p, _ in fake.calls)


def test_a_background_failure_keeps_the_ready_pages() -> None:
    first = len(host_pool("page_first").pinner.ranges[0])  # type: ignore[union-attr]
    fake = FakeRegistrar(fail_at=first)
    pool = host_pool("page_first", registrar=fake, background=True)
    with pytest.raises(ConfigError, match="refused"):
        pool.pinner.wait()  # type: ignore[union-attr]
    assert pool.allocator.available == 2 and pool.allocator.pending == 4
    check(pool)
    pool.close()


def test_host_arena_places_only_in_pinned_places() -> None:
    fake = FakeRegistrar()
    probe = HostArena(WINDOW_SPECS, 4, PS, "page_first")
    unit = probe.unit_bytes
    arena = HostArena(
        WINDOW_SPECS,
        4,
        PS,
        "page_first",
        pin=True,
        registrar=fake,
        chunk_bytes=4 * unit,  # one page with its window envelope per chunk
        background=False,
        align=ALIGN,
    )
    a, pinner = arena.allocator, arena.pinner
    assert pinner is not None and arena.arena.data_ptr() % ALIGN == 0
    arena.check_integrity()
    assert (a.num_pages, a.available, a.pending, arena.pages_ready) == (8, 1, 6, 2)
    assert ids(a.alloc(1)) == [0]
    assert a.alloc(1) is None
    arena.check_integrity()
    assert pinner.pin_next_chunk()
    assert ids(a.alloc(1)) == [1]
    arena.check_integrity()
    assert arena.bytes_used == 8 * unit
    while pinner.pin_next_chunk():
        arena.check_integrity()
    assert a.available == 2 and a.pending == 0 and arena.pages_ready == 8
    covered = registered_bytes(fake.calls)
    start = arena.arena.data_ptr()
    assert set(range(start, start + arena.bytes_total)) <= covered


def test_without_a_registrar_or_cuda_nothing_changes() -> None:
    pool = HostPool(SPECS, 6, PS, "layer_first")
    assert pool.pinner is None and pool.allocator.pending == 0
    assert pool.pages_ready == 6 and pool.pin_seconds == 0.0
    pool.close()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            HostPool(SPECS, 6, PS, pin=True)


def test_lazy_zeros_are_zero_and_aligned() -> None:
    t = lazy_zeros((3, 5), torch.float16, align=4096)
    assert t.data_ptr() % 4096 == 0 and t.is_contiguous()
    assert bool((t == 0).all())


def test_a_pinner_can_stop_between_chunks() -> None:
    buf = lazy_zeros((8, 16), torch.uint8, align=ALIGN)
    fake = FakeRegistrar()
    pinner = HostPinner([Region.of(buf, 1, 8)], 8, fake, chunk_bytes=32, background=False, align=16)
    assert pinner.ready_items == 2
    pinner.stop()
    assert not pinner.pin_next_chunk() and pinner.ready_items == 2
    assert not pinner.wait(timeout=0)


class SignallingRegistrar(FakeRegistrar):
    """Sets ``entered`` when ``register`` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def register(self, ptr: int, nbytes: int) -> None:
        self.entered.set()
        super().register(ptr, nbytes)


def test_no_registration_runs_inside_no_registrations() -> None:
    """A CUDA graph capture holds ``no_registrations``: the pinning thread's next chunk waits
    for its end (a registration during a capture invalidates it), then goes on."""
    buf = lazy_zeros((8, 16), torch.uint8, align=ALIGN)
    fake = SignallingRegistrar()
    pinner = HostPinner([Region.of(buf, 1, 8)], 8, fake, chunk_bytes=32, background=False, align=16)
    fake.entered.clear()
    t = threading.Thread(target=pinner.pin_next_chunk)
    with no_registrations():
        t.start()
        # a negative check, bounded: without the lock the call lands within microseconds
        assert not fake.entered.wait(timeout=0.2)
        assert pinner.ready_items == 2
    t.join()
    assert fake.entered.is_set() and pinner.ready_items == 4
    with no_registrations():  # the capturing thread itself may register (a re-entrant lock)
        assert pinner.pin_next_chunk() and pinner.ready_items == 6
    pinner.release()
    assert len(fake.unregistered) == len(fake.calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_cuda_roundtrip_through_the_last_chunk(layout: str) -> None:
    from kvtier.transfer.mapped import map_pinned

    spec = PoolSpec("kv", 2, (2, 8, 128), torch.bfloat16)  # 128 KiB pages at 16 tokens
    pool = HostPool([spec], 256, 16, layout, pin=True, chunk_bytes=2 << 20)
    pinner = pool.pinner
    assert pinner is not None and len(pinner.ranges) == 16
    assert pool.buffers["kv"].is_pinned()
    assert pinner.wait(timeout=120)
    assert pool.allocator.available == 256
    pages = range(pinner.bounds[-2], pool.num_pages)
    host = pool.page_bytes_view("kv")[:, pages.start : pages.stop]
    dev = torch.device("cuda")
    src = torch.randint(0, 256, host.shape, dtype=torch.uint8, device=dev)
    host.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    back = host.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    # through the device view of the host pool, as the row kernels reach it
    mapped = pool.page_bytes_view("kv", map_pinned(pool.buffers["kv"], dev))
    mapped = mapped[:, pages.start : pages.stop]
    src2 = torch.randint(0, 256, host.shape, dtype=torch.uint8, device=dev)
    mapped.copy_(src2)
    torch.cuda.synchronize()
    assert torch.equal(host.to(dev), src2)
    assert torch.equal(mapped.clone(), src2)
    pool.close()


class PreparingRegistrar(FakeRegistrar):
    """A fake registrar with a ``prepare`` step: both kinds of call in one log."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, int]] = []

    def prepare(self, ptr: int, nbytes: int) -> None:
        self.log.append(("prepare", ptr, nbytes))

    def register(self, ptr: int, nbytes: int) -> None:
        super().register(ptr, nbytes)
        self.log.append(("register", ptr, nbytes))


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_every_range_is_prepared_right_before_it_is_registered(layout: str) -> None:
    fake = PreparingRegistrar()
    pool = host_pool(layout, num_pages=7, chunk_pages=2, registrar=fake)
    pinner = pool.pinner
    assert pinner is not None
    while pinner.pin_next_chunk():
        pass
    assert fake.log == [(kind, ptr, n) for ptr, n in fake.calls for kind in ("prepare", "register")]
    assert pinner.driver_seconds >= 0.0 and len(fake.calls) > 2


@pytest.mark.parametrize("madvise", [True, False])
def test_populate_faults_memory_in_and_keeps_its_bytes(madvise: bool, monkeypatch) -> None:
    from kvtier.pools import pinning
    from kvtier.pools.pinning import PAGE, populate

    if not madvise:  # a kernel without MADV_POPULATE_WRITE: each page touched instead
        monkeypatch.setattr(pinning, "_libc", lambda: None)

    fresh = lazy_zeros((64, PAGE), torch.uint8)
    populate(fresh.data_ptr(), fresh.numel())
    assert torch.count_nonzero(fresh) == 0  # still the kernel's zero pages' contents
    written = lazy_zeros((8, PAGE), torch.uint8)
    written.copy_(torch.arange(8 * PAGE, dtype=torch.int64).remainder(251).view(8, PAGE))
    before = written.clone()
    populate(written.data_ptr(), written.numel())
    assert torch.equal(written, before)

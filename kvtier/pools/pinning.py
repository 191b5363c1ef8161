"""Pinning host memory in the background: a host pool's buffers are registered with the CUDA
driver chunk by chunk on a daemon thread, so that a large host tier does not hold up start-up.

``torch.zeros(..., pin_memory=True)`` pins and zero-fills every byte before it returns: tens of
seconds for a 100 GB host tier. Here the buffers are anonymous private mappings instead (zero by
the kernel's contract, faulted in on first touch, nothing filled up front) and ``cudaHostRegister``
pins them range by range. A pool's *items* (host pages, or an arena's placement slots) become
usable in order as the chunks holding them are registered; :attr:`HostPinner.ready_items`
publishes how many, and the pool's allocator folds newly ready items in on its own thread.

A buffer is a :class:`Region`: ``stripes`` equal contiguous stripes, each holding items
``0 .. items-1`` of ``item_bytes`` in order (a page-first buffer is one stripe; a layer-first
buffer has one stripe per layer). Chunk ``k`` is an item range ``[a_k, a_{k+1})``; its ranges
are every region's stripes' bytes of those items, cut at ``align`` boundaries::

    layer_first, 2 layers, 2 chunks       stripe 0: | chunk 0 | chunk 1 | stripe 1: | 0 | 1 |
    registration order                    chunk 0 of every stripe, then chunk 1 of every stripe

An aligned block that several chunks' bytes share is registered with the earliest of them, so
once chunks ``0 .. k`` are registered every byte of their items is, and no two registrations
share a block (the driver refuses a range that overlaps a registered one).

The driver is held while it registers, and every CUDA call of the engine's thread waits for it
(measured on an H200: a 1 GiB ``cudaHostRegister`` of fresh memory pinned 1.56 GB/s, and the
first request of an engine starting beside a 100 GB host tier waited for all of it). Most of a
registration of fresh memory is the kernel faulting the pages in and zeroing them, which needs
no driver: a registrar with a ``prepare`` step (``CudaRegistrar``: ``populate``) has the range
faulted in first, outside the driver, and the background thread then leaves the driver alone
for at least as long as each registration held it (``pace``), so the engine's calls get
through between chunks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import mmap
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.pools")

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current one."""
HOST_REGISTER_MAPPED = 2
"""``cudaHostRegisterMapped``: mapped into the device address space (``transfer.mapped``)."""
REGISTER_FLAGS = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
DEFAULT_CHUNK_BYTES = 256 << 20
"""Bytes of items registered per step: one chunk is registered before the pool is returned,
the rest in the background. Small, so that the driver is never held long at a time."""
MADV_POPULATE_WRITE = 23
"""Linux ``madvise`` advice (5.14+): fault a range in, writable, without touching it."""
PAGE = mmap.PAGESIZE
DEFAULT_PACE = 4.0
"""How long the pinning thread leaves the driver alone after a chunk, as a multiple of the time
the chunk's registrations held it (``HostPinner.pace``). Faulting the pages in, not registering
them, is most of pinning's time: on an H200 host 100 GB took 29 s at 4 and 34 s at 1, and an
engine's first request beside it 0.9 s against 1.8 s (``results/startup``)."""
DEFAULT_ALIGN = 2 << 20
"""Registration boundaries (bytes). Coarser than the 4 KiB OS page on purpose: whatever block
the driver pins at, two ranges never share one."""


_REGISTRATIONS = threading.RLock()
"""Held around every registration and unregistration (:func:`no_registrations`)."""


@contextlib.contextmanager
def no_registrations() -> Iterator[None]:
    """No host memory is registered or unregistered by a :class:`HostPinner` while inside
    (a registration under way finishes first). Hold it across a CUDA graph capture: under the
    default (global) capture mode a registration from another thread while a stream captures
    invalidates the capture, and the step that captured fails."""
    with _REGISTRATIONS:
        yield


class Registrar(Protocol):
    """Registers host ranges with the driver; ``register`` raises when the driver refuses. A
    registrar may also have ``prepare(ptr, nbytes)``, called for a range before ``register``
    and outside the time :class:`HostPinner` paces by (work that needs no driver)."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


def populate(ptr: int, nbytes: int) -> None:
    """Fault ``nbytes`` of this process's memory from ``ptr`` in, writable, keeping its
    contents (``madvise(MADV_POPULATE_WRITE)``; where the kernel lacks it, one byte of every
    page is read and written back). ``ptr`` must be the start of a page."""
    libc = _libc()
    if (
        libc is not None
        and libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0
    ):
        return
    view = (ctypes.c_ubyte * nbytes).from_address(ptr)
    # a read-then-write of each page's first byte: faulted in for writing, nothing changed
    arr = memoryview(view).cast("B")
    for off in range(0, nbytes, PAGE):
        arr[off] = arr[off]


_LIBC: ctypes.CDLL | None | bool = False


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is False:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            lib.madvise.restype = ctypes.c_int
            _LIBC = lib
        except (OSError, AttributeError):
            _LIBC = None
    return _LIBC  # type: ignore[return-value]


class CudaRegistrar:
    """``cudaHostRegister`` (portable, mapped) through torch's cudart bindings. ``what`` names
    the memory in error messages (e.g. the host tier and its size)."""

    def __init__(self, what: str) -> None:
        self.what = what
        torch.cuda.init()
        self._rt = torch.cuda.cudart()

    def prepare(self, ptr: int, nbytes: int) -> None:
        """Fault the range in first (``populate``): the kernel's part of pinning fresh memory,
        done without the driver."""
        populate(ptr, nbytes)

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._rt.cudaHostRegister(ptr, nbytes, REGISTER_FLAGS)
        if int(rc) != 0:
            raise ConfigError(
                f"pinning the {self.what} failed at {nbytes} bytes from {ptr:#x}: "
                f"cudaHostRegister returned {int(rc)} ({self._rt.cudaGetErrorString(rc)}). "
                "The host may lack that much lockable memory (ulimit -l, container memory "
                "limit, free RAM); make the host tier smaller or set pin_host=False"
            )

    def unregister(self, ptr: int) -> None:
        self._rt.cudaHostUnregister(ptr)


def lazy_zeros(
    shape: Sequence[int], dtype: torch.dtype, align: int = DEFAULT_ALIGN
) -> torch.Tensor:
    """A contiguous zero CPU tensor whose data starts on an ``align`` boundary, in an anonymous
    private mapping that extends at least to the next ``align`` boundary past its end.

    Nothing is written: the kernel hands out zero pages on first touch (or when they are
    pinned), so callers that read never-written bytes still read zeros, as with ``torch.zeros``.
    The tensor keeps the mapping alive.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(tuple(shape), dtype=dtype)
    size = _round_up(nbytes, align) + align
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        # 2 MiB pages: a 512th of the page-table entries to fault in and to pin
        with contextlib.suppress(OSError):  # transparent huge pages off: only slower
            buf.madvise(advice)
    base = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    skip = -base.data_ptr() % align
    return base[skip : skip + nbytes].view(dtype).view(tuple(shape))


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous buffer from ``ptr``: ``stripes`` stripes of ``items * item_bytes`` bytes,
    item ``i`` of stripe ``s`` at ``ptr + (s * items + i) * item_bytes``."""

    ptr: int
    stripes: int
    item_bytes: int

    @classmethod
    def of(cls, t: torch.Tensor, stripes: int, items: int) -> Region:
        """The region of contiguous ``t`` holding ``items`` items in each of ``stripes``."""
        nbytes = t.numel() * t.element_size()
        if not t.is_contiguous() or nbytes % (stripes * items):
            raise ConfigError(f"{tuple(t.shape)} does not split into {stripes} x {items} items")
        return cls(t.data_ptr(), stripes, nbytes // (stripes * items))


def chunk_bounds(items: int, chunk_items: int) -> list[int]:
    """Item boundaries ``[0, c, 2c, ..., items]`` of chunks of ``chunk_items``."""
    return [*range(0, items, max(1, chunk_items)), items]


def plan_ranges(
    regions: Sequence[Region], items: int, bounds: Sequence[int], align: int
) -> list[list[tuple[int, int]]]:
    """``(ptr, nbytes)`` ranges to register per chunk (``bounds`` as :func:`chunk_bounds`).

    Ranges are ``align``-aligned, disjoint, and together cover every region's aligned span;
    an aligned block goes to the earliest chunk with bytes in it. Each region must start on an
    ``align`` boundary with its aligned end still its own memory (:func:`lazy_zeros`).
    """
    out: list[list[tuple[int, int]]] = [[] for _ in range(len(bounds) - 1)]
    for r in regions:
        if r.ptr % align:
            raise ConfigError(f"region at {r.ptr:#x} does not start on a {align}-byte boundary")
        spans: list[list[int]] = []  # [start, end, chunk], increasing, disjoint
        for s in range(r.stripes):
            base = r.ptr + s * items * r.item_bytes
            for k in range(len(bounds) - 1):
                lo = base + bounds[k] * r.item_bytes
                hi = base + bounds[k + 1] * r.item_bytes
                start, end = _round_down(lo, align), _round_up(hi, align)
                if spans and spans[-1][1] > start:
                    # one block shared with earlier pieces: the earliest chunk keeps it
                    last = spans[-1]
                    if k < last[2]:
                        last[1] = start
                        if last[1] <= last[0]:
                            spans.pop()
                    else:
                        start = last[1]
                if end <= start:
                    continue
                if spans and spans[-1][2] == k and spans[-1][1] == start:
                    spans[-1][1] = end
                else:
                    spans.append([start, end, k])
        for start, end, k in spans:
            out[k].append((start, end - start))
    return out


class HostPinner:
    """Registers ``regions`` (sharing one item index of ``items``) chunk by chunk.

    ``first_chunks`` chunks are registered before the constructor returns; with
    ``background`` a daemon thread registers the rest, else the caller steps with
    :meth:`pin_next_chunk`. Between two chunks the thread waits ``pace`` times as long as the
    last one's registrations took (the registrar's ``prepare`` not counted): the driver is
    free for the engine's calls at least that long. :attr:`ready_items` (items ``0 .. ready_items-1`` are registered in
    every region) only grows and is the one thing the thread publishes; it never touches a
    pool's allocator. The pinner keeps ``keep`` (the buffers) alive, so the thread never
    touches freed memory; :meth:`stop` joins it, :meth:`release` also unregisters everything.
    A failure of the first chunks is raised by the constructor (with nothing left registered);
    a background failure is logged, stops the pinning (later items stay unusable) and is
    raised again by :meth:`wait`.
    """

    def __init__(
        self,
        regions: Sequence[Region],
        items: int,
        registrar: Registrar,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        first_chunks: int = 1,
        background: bool = True,
        align: int = DEFAULT_ALIGN,
        keep: Sequence[object] = (),
        pace: float | None = None,
    ) -> None:
        if items <= 0 or chunk_bytes <= 0:
            raise ConfigError(f"pinning {items} items in chunks of {chunk_bytes} bytes")
        item_bytes = sum(r.item_bytes * r.stripes for r in regions)
        self.items = items
        self.bounds = chunk_bounds(items, chunk_bytes // max(1, item_bytes))
        """Item boundaries of the chunks."""
        self.ranges = plan_ranges(regions, items, self.bounds, align)
        """``(ptr, nbytes)`` to register, per chunk."""
        self.ready_items = 0
        """Items registered in every region (a prefix); written by the pinning thread only
        after the driver returned."""
        self.error: BaseException | None = None
        self.driver_seconds = 0.0
        """Seconds spent in ``register`` calls so far (the driver held)."""
        self.pace = DEFAULT_PACE if pace is None else pace
        self._last_driver_s = 0.0
        self._registrar = registrar
        self._prepare = getattr(registrar, "prepare", None)
        self._keep = tuple(keep)
        self._registered: list[int] = []
        self._next = 0
        self._step = threading.Lock()
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()
        self._t0 = time.perf_counter()
        self._t1: float | None = None
        try:
            for _ in range(min(first_chunks, len(self.ranges))):
                self.pin_next_chunk()
        except BaseException:
            self.release()
            raise
        if background and not self.done:
            self._thread = threading.Thread(target=self._run, name="kvtier-pin", daemon=True)
            self._thread.start()
        else:
            self._finished.set()

    @property
    def done(self) -> bool:
        return self.ready_items == self.items

    @property
    def seconds(self) -> float:
        """Seconds from construction until every item was ready (so far, while pinning)."""
        end = self._t1 if self._t1 is not None else time.perf_counter()
        return end - self._t0

    def pin_next_chunk(self) -> bool:
        """Register the next chunk and publish its items; ``False`` when none is left."""
        with self._step:
            if self._next >= len(self.ranges) or self._stopping.is_set():
                return False
            k = self._next
            held = 0.0
            for ptr, nbytes in self.ranges[k]:
                if self._prepare is not None:
                    self._prepare(ptr, nbytes)
                with _REGISTRATIONS:
                    t = time.perf_counter()
                    self._registrar.register(ptr, nbytes)
                    held += time.perf_counter() - t
                self._registered.append(ptr)
            self.driver_seconds += held
            self._last_driver_s = held
            self._next = k + 1
            with self._changed:
                self.ready_items = self.bounds[k + 1]
                if self.done:
                    self._t1 = time.perf_counter()
                self._changed.notify_all()
            return True

    def wait(self, items: int | None = None, timeout: float | None = None) -> bool:
        """Block until ``items`` (all by default) are ready; ``False`` on timeout or when
        pinning stopped short (a failure is raised)."""
        want = self.items if items is None else items
        with self._changed:
            self._changed.wait_for(
                lambda: self.ready_items >= want or self._finished.is_set(), timeout
            )
        self._raise()
        return self.ready_items >= want

    def stop(self) -> None:
        """Stop pinning and join the thread (idempotent); registered memory stays so and
        items not ready by then stay unusable."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> None:
        """:meth:`stop`, then unregister every registered range (the buffers stay valid,
        pageable). For the owner's end of life: no device copy may still be using them."""
        self.stop()
        with self._step, _REGISTRATIONS:
            for ptr in self._registered:
                self._registrar.unregister(ptr)
            self._registered.clear()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while self.pin_next_chunk():
                # the engine's CUDA calls queued behind the driver go now (stop cuts it short)
                if self.pace > 0 and self._stopping.wait(self.pace * self._last_driver_s):
                    break
        except BaseException as e:  # noqa: BLE001 - reported to the owner, not lost in a thread
            self.error = e
            log.error(
                "host memory pinning stopped at %d of %d items: %s", self.ready_items, self.items, e
            )
        with self._changed:
            self._finished.set()
            self._changed.notify_all()


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _round_down(x: int, a: int) -> int:
    return x // a * a

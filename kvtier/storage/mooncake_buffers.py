"""Plumbing under the Mooncake L3 backend (``kvtier.storage.mooncake``): the worker threads that
run store calls, the classes of store error codes, and ``TransferBuffers``, the memory the
client transfers through.

``TransferBuffers`` owns a few ``Arena``s (each: one envelope-header slot per object of two
transfer groups and two bounce halves, staging for payloads outside registered memory, grown on
demand) and the list of caller buffers given to ``register_buffers``; it registers all of them
with the connected client. A batch travels in transfer groups of at most ``GROUP_KEYS`` objects
whose bounced payloads fit one bounce half, and at most ``GROUP_BYTES`` (reads) or
``PUT_GROUP_BYTES`` (writes) bytes. Several arenas exist so that a call abandoned after its
timeout keeps the one it writes into while later calls use another.

The client busy-polls the thread that called it until its transfers complete (the wheels are
built without event-driven completion): a put or get keeps a core spinning for its whole
length. ``Worker`` threads therefore run at a lowered priority (``nice``), so on a host short of
cores the spin yields to the transfer's own threads, the payload digests and the engine instead
of taking a core from them; the spin still notices completion within a scheduler slice.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvtier.storage.envelope import HEADER_BYTES

log = logging.getLogger("kvtier.storage")

Bytes = memoryview | np.ndarray
"""A flat byte buffer: a caller's (``cpu_byte_views``) or a slice of an arena."""

GROUP_KEYS = 128
GROUP_BYTES = 64 << 20
PUT_GROUP_BYTES = 256 << 20
"""Writes take larger groups than reads: each put call costs two master round trips
(allocation, commit) and a drain of the link, and the next group is staged while one is in
flight; a read group's payloads are verified while the next one lands, so its groups stay
small enough for the last one's verification (not overlapped) to be short."""
PUT_BYTES_PER_TIMEOUT_S = 128 << 20
"""A put call also carries at most this many bytes per second of ``timeout_s``, so that one
still ends in time on a link (or a host short of cores) at an eighth of 1 GB/s."""
MISSING = (-703, -704)  # replica not ready, object not found
UNREACHABLE = (-800, -900, -901, -1010, -1011)  # transfer/RPC failure, unavailable
NO_SPACE = (-200, -1700)  # no segment space, tenant quota


def lower_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux, where a nice value is per
    thread; elsewhere, or when refused, nothing). Threads it starts later inherit it."""
    if nice <= 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # e.g. a sandbox without the call: run at the process's priority
        log.debug("mooncake worker priority unchanged: %s", e)


class Worker:
    """Up to ``threads`` daemon threads running store calls, one call per thread (daemon: a call
    stuck in the library must not hold up interpreter exit). A call that hangs keeps its thread;
    later calls run on the others, so one hang delays nothing but itself. The threads run
    ``nice`` steps below the process (see the module docstring)."""

    def __init__(self, name: str, threads: int = 1, nice: int = 0) -> None:
        self._name, self._max, self._nice = name, threads, nice
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._busy = self._threads = 0

    def submit(self, fn: Callable[[], Any]) -> Future | None:
        """Start ``fn``; ``None`` while every thread is busy with an earlier call."""
        with self._cond:
            if self._busy >= self._max:
                return None
            self._busy += 1
            if self._busy > self._threads:  # every queued call has an idle thread to run it
                self._threads += 1
                name = f"{self._name}-{self._threads}"
                threading.Thread(target=self._loop, name=name, daemon=True).start()
        fut: Future = Future()
        self._jobs.put((fn, fut))
        return fut

    def wait_idle(self, timeout: float) -> bool:
        """Whether no call is running, waiting up to ``timeout`` for that."""
        with self._cond:
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def stop(self) -> None:
        for _ in range(self._threads):
            self._jobs.put(None)

    def _loop(self) -> None:
        lower_priority(self._nice)
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            value, exc = None, None
            try:
                value = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                exc = e
            # Free before answering, so a caller woken by the answer can submit the next call.
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
            if exc is None:
                fut.set_result(value)
            else:
                fut.set_exception(exc)


def ptr(a: np.ndarray) -> int:
    """Address of ``a``'s first byte."""
    return a.ctypes.data


def _span(a: np.ndarray) -> tuple[int, int]:
    return ptr(a), ptr(a) + a.nbytes


class Arena:
    """What one batch call transfers through: header slots for two transfer groups and two
    bounce halves (staging for payloads outside registered memory, grown on demand).

    Held by one batch call, and after it returns by its store calls until every one of them
    ended: a call abandoned after its timeout may still write headers or bounced payloads
    here, so the arena is not handed out again before that.
    """

    def __init__(self, owner: TransferBuffers) -> None:
        self._owner = owner
        self.headers = np.zeros(2 * GROUP_KEYS * HEADER_BYTES, dtype=np.uint8)
        self._headers_at = ptr(self.headers)
        self.bounce = [np.zeros(0, np.uint8), np.zeros(0, np.uint8)]  # allocated when needed
        self.held = False
        self.running = 0  # store calls of past batch calls not yet ended

    @property
    def bounce_bytes(self) -> int:
        """Bytes of one bounce half."""
        return self.bounce[0].nbytes

    def prepare(self, views: Sequence[Bytes], addrs: list[int]) -> list[bool]:
        """Whether each of ``views`` (first bytes at ``addrs``) lies in registered memory (sent
        and received in place); grows the bounce halves first when one payload outside it
        would not fit a half (only before any call of this batch: a running call may be using
        a half)."""
        inside = self._owner.inside
        direct = [inside(a, v.nbytes) for v, a in zip(views, addrs, strict=True)]
        need = max((v.nbytes for v, d in zip(views, direct, strict=True) if not d), default=0)
        if need > self.bounce_bytes:
            self._owner.grow_bounce(self, max(need, self._owner.bounce_bytes))
        return direct

    def plan(self, views: Sequence[Bytes], addrs: list[int]) -> list[tuple[range, list[int]]]:
        """Read groups of consecutive objects (``GROUP_KEYS``, ``GROUP_BYTES``, bounced bytes
        within a half), each with its objects' bounce offsets (-1: direct)."""
        groups, start, size, staged, offs = [], 0, 0, 0, []
        for i, (v, direct) in enumerate(zip(views, self.prepare(views, addrs), strict=True)):
            need = 0 if direct else v.nbytes
            if offs and (
                len(offs) == GROUP_KEYS
                or size + v.nbytes > GROUP_BYTES
                or staged + need > self.bounce_bytes
            ):
                groups.append((range(start, i), offs))
                start, size, staged, offs = i, 0, 0, []
            offs.append(staged if need else -1)
            size, staged = size + v.nbytes, staged + need
        return [*groups, (range(start, len(views)), offs)] if offs else groups

    def header(self, g: int, j: int) -> np.ndarray:
        """Header slot of object ``j`` of group ``g``; consecutive groups use different halves
        of the arena, so one can be verified (or staged) while the next (or previous) is in
        flight."""
        slot = ((g % 2) * GROUP_KEYS + j) * HEADER_BYTES
        return self.headers[slot : slot + HEADER_BYTES]

    def header_at(self, g: int, j: int) -> int:
        """Address of ``header(g, j)``."""
        return self._headers_at + ((g % 2) * GROUP_KEYS + j) * HEADER_BYTES

    def bounced(self, g: int, off: int, nbytes: int) -> np.ndarray:
        """``nbytes`` of group ``g``'s bounce half from ``off``."""
        return self.bounce[g % 2][off : off + nbytes]

    def layout(
        self, g: int, rng: range, offs: list[int], views: Sequence[Bytes], addrs: list[int]
    ) -> tuple[list[list[int]], list[list[int]], list[Bytes]]:
        """Buffer pointers and sizes (header slot, payload) of group ``g``'s objects, and where
        each payload lies: the caller's buffer (first byte at ``addrs[i]``) or a slice of the
        bounce arena."""
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        places: list[Bytes] = []
        bounce_at = ptr(self.bounce[g % 2])
        for j, (i, off) in enumerate(zip(rng, offs, strict=True)):
            v = views[i]
            place = v if off < 0 else self.bounced(g, off, v.nbytes)
            ptrs.append([self.header_at(g, j), addrs[i] if off < 0 else bounce_at + off])
            sizes.append([HEADER_BYTES, v.nbytes])
            places.append(place)
        return ptrs, sizes, places


class TransferBuffers:
    """``arenas`` arenas plus registered caller memory, for one backend.

    ``client`` returns the backend's connected client (``None`` before it connects and after
    it closes); registrations go to it. A batch call ``acquire``s an arena and ``release``s it
    with the futures of the store calls it made; the arena is free again once they all ended.
    """

    def __init__(self, bounce_bytes: int, client: Callable[[], Any], arenas: int = 1) -> None:
        # The backend holds it from setting its client through ``attach``, so a concurrent
        # ``register_buffers`` is either in ``_wanted`` by then or sees the new client.
        self.lock = threading.Lock()
        self._arena_lock = threading.Lock()
        self._client = client
        self.bounce_bytes = bounce_bytes
        self._regions: list[tuple[int, int]] = []
        self._arenas = [Arena(self) for _ in range(arenas)]
        self._wanted = [_span(a.headers) for a in self._arenas]

    def acquire(self) -> Arena | None:
        """A free arena, now held by the caller; ``None`` while every one is held or still in
        use by calls that outlived their timeout."""
        with self._arena_lock:
            for a in self._arenas:
                if not a.held and not a.running:
                    a.held = True
                    return a
        return None

    def release(self, arena: Arena, futures: Sequence[Future | None]) -> None:
        """The batch call holding ``arena`` returned; its store calls ``futures`` may still run
        (abandoned after a timeout): the arena is free once they all ended."""
        live = [f for f in futures if f is not None]
        with self._arena_lock:
            arena.held = False
            arena.running += len(live)
        for f in live:
            f.add_done_callback(lambda _f, a=arena: self._ended(a))

    def _ended(self, arena: Arena) -> None:
        with self._arena_lock:
            arena.running -= 1

    def attach(self, store: Any) -> None:
        """Register every wanted region with ``store``, a newly connected client (``lock``
        held)."""
        self._regions = []
        for start, end in self._wanted:
            self._register(store, start, end)

    def _register(self, store: Any, start: int, end: int) -> None:
        if store.register_buffer(start, end - start) == 0:
            self._regions.append((start, end))
        else:
            log.warning("mooncake register_buffer(%#x, %d) failed; bouncing", start, end - start)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register each contiguous CPU buffer once; reads and writes inside them skip the
        bounce arena."""
        with self.lock:
            for b in buffers:
                if b.device.type != "cpu" or not b.is_contiguous() or not b.numel():
                    continue
                start = b.data_ptr()
                end = start + b.numel() * b.element_size()
                if any(s <= start and end <= e for s, e in self._wanted):
                    continue
                self._wanted.append((start, end))
                client = self._client()
                if client is not None:
                    self._register(client, start, end)

    def inside(self, addr: int, nbytes: int) -> bool:
        """Whether the ``nbytes`` from ``addr`` lie in registered memory (transfers reach them
        without bouncing)."""
        end = addr + nbytes
        return any(s <= addr and end <= e for s, e in self._regions)

    def grow_bounce(self, arena: Arena, nbytes: int) -> None:
        """Replace both bounce halves of ``arena`` (held by the caller, none of its calls
        running) by ``nbytes`` ones."""
        with self.lock:
            client = self._client()
            for half, old in enumerate(arena.bounce):
                arena.bounce[half] = new = np.zeros(nbytes, np.uint8)
                old_span, new_span = _span(old), _span(new)
                if old_span in self._wanted:
                    self._wanted.remove(old_span)
                self._wanted.append(new_span)
                if old_span in self._regions and client is not None:
                    self._regions.remove(old_span)
                    client.unregister_buffer(old_span[0])
                if client is not None:
                    self._register(client, *new_span)

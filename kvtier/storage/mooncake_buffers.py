"""Plumbing under the Mooncake L3 backend (``kvtier.storage.mooncake``): the worker thread that
runs store calls, the classes of store error codes, and ``TransferBuffers``, the memory the
client transfers through.

``TransferBuffers`` owns the header arena (one envelope-header slot per object of two transfer
groups), the two bounce halves (staging for payloads outside registered memory, grown on demand)
and the list of caller buffers given to ``register_buffers``; it registers all of them with the
connected client and splits a batch into transfer groups of at most ``GROUP_KEYS`` objects and
``GROUP_BYTES`` bytes whose bounced payloads fit one bounce half.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from kvtier.storage.envelope import HEADER_BYTES

log = logging.getLogger("kvtier.storage")

GROUP_KEYS = 128
GROUP_BYTES = 64 << 20
MISSING = (-703, -704)  # replica not ready, object not found
UNREACHABLE = (-800, -900, -901, -1010, -1011)  # transfer/RPC failure, unavailable
NO_SPACE = (-200, -1700)  # no segment space, tenant quota


class Worker:
    """A daemon thread running one store call at a time (daemon: a call stuck in the library
    must not hold up interpreter exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._current: Future | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future | None:
        """Start ``fn``; ``None`` while the previous call is still running."""
        with self._lock:
            if self._current is not None and not self._current.done():
                return None
            fut: Future = Future()
            self._current = fut
        self._jobs.put((fn, fut))
        return fut

    def wait_idle(self, timeout: float) -> bool:
        cur = self._current
        return cur is None or not concurrent.futures.wait([cur], timeout).not_done

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)


def bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as a uint8 array sharing its memory."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"storage buffers must be contiguous CPU tensors, got {tensor.device}")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _span(a: np.ndarray) -> tuple[int, int]:
    return _ptr(a), _ptr(a) + a.nbytes


class TransferBuffers:
    """Header and bounce arenas plus registered caller memory, for one backend.

    ``client`` returns the backend's connected client (``None`` before it connects and after
    it closes); registrations go to it. ``plan``, ``header``, ``layout`` and ``stage`` are used
    by one data call at a time and only while no earlier data call still runs.
    """

    def __init__(self, bounce_bytes: int, client: Callable[[], Any]) -> None:
        # The backend holds it from setting its client through ``attach``, so a concurrent
        # ``register_buffers`` is either in ``_wanted`` by then or sees the new client.
        self.lock = threading.Lock()
        self._client = client
        self._bounce_bytes = bounce_bytes
        self._regions: list[tuple[int, int]] = []
        self._headers = np.zeros(2 * GROUP_KEYS * HEADER_BYTES, dtype=np.uint8)
        self._wanted = [_span(self._headers)]
        self._bounce = [np.zeros(0, np.uint8), np.zeros(0, np.uint8)]  # allocated when needed

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

    def _inside(self, a: np.ndarray) -> bool:
        p, q = _span(a)
        return any(s <= p and q <= e for s, e in self._regions)

    def plan(self, views: list[np.ndarray]) -> list[tuple[range, list[int]]]:
        """Groups of consecutive objects, each with its objects' bounce offsets (-1: direct)."""
        groups, start, size, staged, offs = [], 0, 0, 0, []
        for i, v in enumerate(views):
            need = 0 if self._inside(v) else v.nbytes
            if need > self._bounce[0].nbytes:
                self._grow_bounce(max(need, self._bounce_bytes))
            if offs and (
                len(offs) == GROUP_KEYS
                or size + v.nbytes > GROUP_BYTES
                or staged + need > self._bounce[0].nbytes
            ):
                groups.append((range(start, i), offs))
                start, size, staged, offs = i, 0, 0, []
            offs.append(staged if need else -1)
            size, staged = size + v.nbytes, staged + need
        return [*groups, (range(start, len(views)), offs)] if offs else groups

    def _grow_bounce(self, nbytes: int) -> None:
        """Replace both bounce halves by ``nbytes`` ones (only while no data call runs)."""
        with self.lock:
            client = self._client()
            for half, old in enumerate(self._bounce):
                self._bounce[half] = new = np.zeros(nbytes, np.uint8)
                old_span, new_span = _span(old), _span(new)
                if old_span in self._wanted:
                    self._wanted.remove(old_span)
                self._wanted.append(new_span)
                if old_span in self._regions and client is not None:
                    self._regions.remove(old_span)
                    client.unregister_buffer(old_span[0])
                if client is not None:
                    self._register(client, *new_span)

    def header(self, g: int, j: int) -> np.ndarray:
        """Header slot of object ``j`` of group ``g``; consecutive groups use different halves
        of the arena, so one can be verified while the next is in flight."""
        slot = ((g % 2) * GROUP_KEYS + j) * HEADER_BYTES
        return self._headers[slot : slot + HEADER_BYTES]

    def layout(
        self, g: int, rng: range, offs: list[int], views: list[np.ndarray]
    ) -> tuple[list[list[int]], list[list[int]], list[np.ndarray]]:
        """Buffer pointers and sizes (header slot, payload) of group ``g``'s objects, and where
        each payload lies: the caller's buffer or a slice of the bounce arena."""
        ptrs, sizes, places = [], [], []
        for j, (i, off) in enumerate(zip(rng, offs, strict=True)):
            v = views[i]
            place = v if off < 0 else self._bounce[g % 2][off : off + v.nbytes]
            ptrs.append([_ptr(self.header(g, j)), _ptr(place)])
            sizes.append([HEADER_BYTES, v.nbytes])
            places.append(place)
        return ptrs, sizes, places

    def stage(
        self, g: int, rng: range, offs: list[int], views: list[np.ndarray], heads: list[bytes]
    ) -> tuple[list[list[int]], list[list[int]], int]:
        """``layout`` of group ``g`` for writing: ``heads`` (packed envelope headers) copied
        into its header slots and payloads outside registered memory into the bounce arena.
        Returns pointers, sizes and the number of bytes bounced."""
        ptrs, sizes, places = self.layout(g, rng, offs, views)
        bounced = 0
        for j, (i, place, head) in enumerate(zip(rng, places, heads, strict=True)):
            v = views[i]
            if place is not v:
                place[:] = v
                bounced += v.nbytes
            self.header(g, j)[:] = np.frombuffer(head, np.uint8)
        return ptrs, sizes, bounced

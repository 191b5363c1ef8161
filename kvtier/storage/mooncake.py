"""Mooncake Store L3 backend, ``MooncakeBackend``: page objects in a Mooncake distributed memory
pool. This module holds the storage contract (exists/get/set); the connection, health and probing
are in ``kvtier.storage.mooncake_session``; worker threads, store error codes and the registered
arenas in ``kvtier.storage.mooncake_buffers``.

Configured by one string, ``CacheConfig.storage_url`` (format in ``kvtier.storage.mooncake_url``).
Objects are stored under ``kvtier/<namespace>/<key>`` as envelope header + payload, written and
read with the header in a registered arena and the payload straight from/to the caller's buffer
when that lies in memory given to ``register_buffers``. Reads verify the envelope and payload
digest; a failure is a miss counted by its kind and the object is removed (best effort).

Health: a store call that exceeds ``timeout_s`` or answers an RPC/transfer failure marks the
backend unhealthy (``outages``); calls then answer misses without touching the store, and one
probe runs in the background after a backoff of 0.5 s doubling to 10 s; its success marks the
backend healthy again (``reconnects``). Start-up never fails on an unreachable master: the backend
starts unhealthy, logs a warning naming the master, and connects on a later probe. After a master
restart the client reconnects by itself (the restarted master has lost every object).

Hung calls. Every store call (get, put, exists, remove, size) is waited for at most ``timeout_s``;
a late call is a ``timeout`` miss and is abandoned, keeping its worker thread (later calls run on
the others, up to ``DATA_CALLS`` at once). The library only ever transfers into or out of
registered memory, so what a late call can still touch is (a) its arena (headers and bounced
payloads), which is not handed to another call before it ended, and (b) caller buffers that lie
in registered memory (the host pool, read zero-copy). For (b), ``read_fence`` gives the caller a
future that completes once no abandoned read is running; ``kvtier.controller.prefetch`` keeps the pages of a
short read allocated until then, so a late answer never lands in a host page that was reused. A
late put may have read host pages after the caller let them go: once it ends, the objects it
wrote are removed (best effort; a survivor fails its payload digest on read, a counted miss).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import ConfigError, StorageError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.base import (
    StorageBackend,
    StorageCapabilities,
    check_lengths,
    cpu_byte_views,
)
from kvtier.storage.envelope import HEADER_BYTES
from kvtier.storage.mooncake_buffers import (
    GROUP_KEYS,
    PUT_BYTES_PER_TIMEOUT_S,
    PUT_GROUP_BYTES,
    Arena,
    Bytes,
    TransferBuffers,
    ptr,
)
from kvtier.storage.mooncake_session import DATA_CALLS, MooncakeSession
from kvtier.storage.mooncake_url import parse_storage_url

if TYPE_CHECKING:
    from kvtier.config import CacheConfig

log = logging.getLogger("kvtier.storage")


class MooncakeBackend(StorageBackend):
    """Objects in a Mooncake Store cluster, shared by every process connected to it.

    Thread-safe: ``batch_get``/``batch_set`` calls each hold an arena; ``batch_exists`` runs on
    its own worker threads.
    """

    name = "mooncake"
    capabilities = StorageCapabilities(
        page_spans=True, zero_copy=True, persistent=False, shared_across_hosts=True
    )

    def __init__(self, storage_url: str, namespace: Namespace, store_cls: Any = None) -> None:
        """Parse ``storage_url`` and connect, waiting up to ``max(timeout_s, 5 s)``.
        ``store_cls`` replaces ``MooncakeDistributedStore`` (a wrapper around it, in tests).

        Raises ``ConfigError`` for a malformed URL or when ``mooncake.store`` cannot be imported.
        """
        super().__init__()
        self.settings = parse_storage_url(storage_url)
        if store_cls is None:
            try:
                from mooncake.store import MooncakeDistributedStore as store_cls
            except ImportError as e:
                raise ConfigError(
                    f"storage_url={storage_url!r} needs the Mooncake client (pip install "
                    f"'kvtier[mooncake]', and the system library libibverbs1): {e}"
                ) from e
        self.namespace = namespace
        self._prefix = f"kvtier/{namespace}/"
        self._buffers = TransferBuffers(
            self.settings.bounce, lambda: self.session.client, arenas=DATA_CALLS
        )
        self._late_lock = threading.Lock()
        self._late_reads: list[Future] = []
        self._late_puts: list[Future] = []
        self.session = MooncakeSession(
            self.settings,
            store_cls,
            self._prefix + "probe",
            self._buffers,
            self.fault,
        )
        if not self.session.start(max(self.settings.timeout_s, 5.0)):
            log.warning(
                "mooncake master %s not reachable at start-up (%s); L3 misses until it is",
                self.settings.master,
                self.session.reason,
            )

    @classmethod
    def from_config(cls, config: CacheConfig, namespace: Namespace) -> MooncakeBackend:
        """Backend for ``config.storage_url``."""
        url = getattr(config, "storage_url", None)
        if not url:
            raise ConfigError("storage='mooncake' needs storage_url (mooncake://HOST:PORT?...)")
        return cls(url, namespace)

    def store_key(self, key: str) -> str:
        """The Mooncake key object ``key`` is stored under."""
        return self._prefix + key

    def wait_healthy(self, timeout_s: float) -> bool:
        """Probe (respecting the backoff) until the store answers or ``timeout_s`` passed;
        returns whether it is healthy."""
        return self.session.wait_healthy(timeout_s)

    def _data_ready(
        self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]
    ) -> tuple[Any, list[Bytes], list[int], Arena | None]:
        """``session.ready()`` for reading or writing ``buffers`` under ``keys``, with their byte
        views, their addresses and a free arena (none while every arena is held by a call that
        outlived its timeout: then no client, counted ``skipped``)."""
        check_lengths(keys, buffers)
        client = self.session.ready() if keys else None
        if client is None:
            return None, [], [], None
        views = cpu_byte_views(buffers)  # raises before anything is held
        addrs = [b.data_ptr() for b in buffers]
        arena = self._buffers.acquire()
        if arena is None:
            self.session.count(skipped=1)
            return None, [], [], None
        return client, views, addrs, arena

    def read_fence(self) -> Future[None] | None:
        """A future done once no abandoned read can still write into registered caller buffers
        (``None``: none can now)."""
        with self._late_lock:
            late = self._late_reads = [f for f in self._late_reads if not f.done()]
            late = list(late)
        return _fence(late)

    def write_fence(self) -> Future[None] | None:
        """A future done once no abandoned put can still read registered caller buffers
        (``None``: none can now)."""
        with self._late_lock:
            late = self._late_puts = [f for f in self._late_puts if not f.done()]
            late = list(late)
        return _fence(late)

    def _get_done(self, fut: Future | None) -> Any:
        """``session.wait`` for a get; a get abandoned while still running joins the fence."""
        codes = self.session.wait(fut, "get")
        if codes is None and fut is not None and not fut.done():
            with self._late_lock:
                self._late_reads.append(fut)
        return codes

    # ---- data path ------------------------------------------------------------------------
    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register each contiguous CPU buffer once; reads and writes inside them skip the
        bounce arena."""
        self._buffers.register_buffers(buffers)

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Length of the leading run of ``keys`` present in the store (one batched call)."""
        client = self.session.ready() if keys else None
        if client is None:
            return 0
        names = [self._prefix + k for k in keys]
        codes = self.session.wait(
            self.session.submit(self.session.meta, lambda: client.batch_is_exist(names)), "exist"
        )
        n = 0
        for code in codes or ():
            if code != 1:
                if code < 0:
                    self.session.code_fault(code, "batch_is_exist")
                break
            n += 1
        return n

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store ``buffers`` under ``keys`` in order; stops at the first fault (``timeout``,
        ``unreachable``, ``no_space``, ``io``). Keys already stored count as stored.

        One put call is in flight while the caller's thread stages the objects after it
        (payload digest, header packed into its registered slot, a payload outside registered
        memory copied to the bounce arena). The staged objects go out as the next call as soon
        as the one in flight has ended (looked at after each object) or the group is full, so
        the groups grow to what the link takes while the digests run ahead, whatever the
        ratio of digest to link speed; the first call leaves once ``FIRST_PUT_BYTES`` are
        staged. A group is full at ``GROUP_KEYS`` objects, a bounce half of bounced payload,
        or ``PUT_GROUP_BYTES`` (at most ``PUT_BYTES_PER_TIMEOUT_S`` per second of
        ``timeout_s``)."""
        client, views, addrs, arena = self._data_ready(keys, buffers)
        if client is None or arena is None:
            return 0
        futs: list[Future | None] = []
        try:
            return self._put_all(client, keys, views, addrs, arena, futs)
        finally:
            self._buffers.release(arena, futs)

    def _put_all(
        self,
        client: Any,
        keys: Sequence[PageKey],
        views: list[Bytes],
        addrs: list[int],
        arena: Arena,
        futs: list[Future | None],
    ) -> int:
        direct = arena.prepare(views, addrs)
        half = arena.bounce_bytes
        cap = min(PUT_GROUP_BYTES, int(self.settings.timeout_s * PUT_BYTES_PER_TIMEOUT_S))
        stored = bounced = 0
        g, group, flight = 0, _PutGroup(), None

        def send() -> bool:
            """Collect the call in flight, then send ``group``; ``False`` after a fault."""
            nonlocal stored, g, group, flight
            if flight is not None:
                stored += (got := self._put_done(client, flight))
                if got < len(flight.names):
                    return False
            flight = self._put(client, group, futs)
            g, group = g + 1, _PutGroup()
            return True

        try:
            for i, v in enumerate(views):
                nbytes = v.nbytes
                need = 0 if direct[i] else nbytes
                full = bool(group.names) and (
                    len(group.names) == GROUP_KEYS
                    or group.nbytes + nbytes > cap
                    or group.staged + need > half
                )
                if full and not send():  # waits for the call in flight
                    return stored
                slot = arena.header(g, len(group.names))
                if need:
                    place = arena.bounced(g, group.staged, nbytes)
                    place[:] = v
                    at = ptr(place)
                    bounced += nbytes
                else:
                    place, at = v, addrs[i]
                # The digest of what is sent (a bounced copy is cache-hot here).
                envelope.pack_into(slot, self.namespace, keys[i], nbytes, envelope.digest(place))
                head_at = arena.header_at(g, len(group.names))
                group.add(self._prefix + keys[i], head_at, at, nbytes, need)
                if flight is None:
                    idle = group.nbytes >= FIRST_PUT_BYTES
                else:
                    idle = flight.fut is None or flight.fut.done()
                if idle and i + 1 < len(views) and not send():
                    return stored
        finally:
            if bounced:
                self.session.count(bytes_bounced=bounced)
        if group.names and not send():
            return stored
        if flight is not None:
            stored += self._put_done(client, flight)
        return stored

    def _put(self, client: Any, group: _PutGroup, futs: list[Future | None]) -> _PutGroup:
        """Start ``group``'s put call; returns it with its future (``None``: not started)."""
        n, p, s = group.names, group.ptrs, group.sizes
        group.fut = self.session.submit(
            self.session.data, lambda: client.batch_put_from_multi_buffers(n, p, s)
        )
        futs.append(group.fut)
        return group

    def _put_done(self, client: Any, group: _PutGroup) -> int:
        """How many of ``group``'s objects its put stored, as a leading run (waits up to
        ``timeout_s`` for it)."""
        fut, names = group.fut, group.names
        codes = self.session.wait(fut, "put")
        if codes is None and fut is not None and not fut.done():
            # It may read the caller's pages after they were reused: drop what it wrote.
            with self._late_lock:
                self._late_puts.append(fut)
            fut.add_done_callback(lambda _f: self._remove_late(client, names))
        n = 0
        for code in codes or ():
            if code not in (0, -705):  # -705: already stored
                self.session.code_fault(code, "batch_put_from_multi_buffers")
                break
            n += 1
        if n:
            self.session.count(bytes_put=sum(group.sizes[j][1] for j in range(n)))
        return n

    def _remove_late(self, client: Any, names: list[str]) -> None:
        def remove() -> None:
            for name in names:
                client.remove(name, True)

        self.session.submit(self.session.data, remove)

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Read and verify objects into ``buffers`` in order; stops at the first miss or fault
        (``foreign``, ``format``, ``checksum``, ``short_read``, ``timeout``, ``unreachable``,
        ``io``). Objects that fail verification are removed from the store. Returns within
        about ``timeout_s`` per transfer group even when the store hangs (see ``read_fence``)."""
        client, views, addrs, arena = self._data_ready(keys, buffers)
        if client is None or arena is None:
            return 0
        groups: list[tuple[range, list[int]]] = []
        futs: list[Future | None] = []

        def submit(g: int) -> tuple[Future | None, list[Bytes]]:
            names = [self._prefix + keys[i] for i in groups[g][0]]
            ptrs, sizes, places = arena.layout(g, *groups[g], views, addrs)
            fn = lambda: client.batch_get_into_multi_buffers(names, ptrs, sizes)  # noqa: E731
            futs.append(self.session.submit(self.session.data, fn))
            return futs[-1], places

        done, bad = 0, []
        try:
            groups += arena.plan(views, addrs)
            fut, places = submit(0)
            for g, (rng, _) in enumerate(groups):
                codes = self._get_done(fut)
                if codes is None:
                    break
                nxt = None
                if g + 1 < len(groups) and all(c >= 0 for c in codes):
                    nxt = submit(g + 1)
                got = self._verify(arena, g, rng, codes, keys, views, places, bad)
                done += got
                if got < len(rng) or nxt is None:
                    if nxt is not None:
                        self._get_done(nxt[0])  # its bytes may be landing in the buffers
                    break
                fut, places = nxt
        finally:
            self._buffers.release(arena, futs)
        for name in bad:
            self.session.wait(
                self.session.submit(self.session.data, lambda n=name: client.remove(n, True)),
                "remove",
            )
        return done

    def _verify(
        self,
        arena: Arena,
        g: int,
        rng: range,
        codes: list[int],
        keys: Sequence[PageKey],
        views: list[Bytes],
        places: list[Bytes],
        bad: list[str],
    ) -> int:
        """How many of group ``g``'s objects (``rng``), as a leading run, are whole and this
        deployment's; copies bounced payloads out to the caller and counts bytes once a
        group."""
        n = got = bounced = 0
        try:
            for j, (i, code, place) in enumerate(zip(rng, codes, places, strict=True)):
                v = views[i]
                if not self._verify_one(arena, g, j, code, keys[i], v, place, bad):
                    return n
                if place is not v:
                    v[:] = place
                    bounced += v.nbytes
                n += 1
                got += v.nbytes
            return n
        finally:
            self.session.count(bytes_got=got, bytes_bounced=bounced)

    def _verify_one(
        self,
        arena: Arena,
        g: int,
        j: int,
        code: int,
        key: PageKey,
        v: Bytes,
        place: Bytes,
        bad: list[str],
    ) -> bool:
        """Whether object ``j`` of group ``g`` (``key``, landed in ``place`` for the caller's
        ``v``; the get answered ``code``) is whole and this deployment's; a fault is counted
        and the object's name added to ``bad``."""
        name = self._prefix + key
        try:
            if code in (-600, -800):
                self._check_size(name, HEADER_BYTES + v.nbytes)
            if code < 0:
                self.session.code_fault(code, "batch_get_into_multi_buffers")
                return False
            head = arena.header(g, j)[: min(code, HEADER_BYTES)].tobytes()
            length, want = envelope.unpack(head, self.namespace, key)
            if code - HEADER_BYTES < length:
                raise StorageError("short_read", f"{code - HEADER_BYTES} of {length} B")
            if length != v.nbytes or code - HEADER_BYTES != length:
                raise StorageError("checksum", f"{length}-byte payload, buffer {v.nbytes}")
            if envelope.digest(place) != want:
                raise StorageError("checksum", "payload checksum mismatch")
        except StorageError as e:
            self.fault(e.kind, f"{name}: {e.detail}")
            bad.append(name)
            return False
        return True

    def _check_size(self, name: str, want: int) -> None:
        """Raise the envelope fault of an object whose size is not ``want`` bytes; the store
        answers such a read with the same codes as a buffer or transfer failure."""
        client = self.session.client
        fut = (
            self.session.submit(self.session.data, lambda: client.get_size(name))
            if client
            else None
        )
        size = self.session.wait(fut, "get_size")
        if isinstance(size, int) and 0 <= size < want:
            raise StorageError("short_read", f"{size}-byte object, expected {want}")
        if isinstance(size, int) and size > want:
            raise StorageError("checksum", f"{size}-byte object, expected {want}")

    def stats(self) -> dict[str, float]:
        """``healthy`` (1/0), ``outages``, ``reconnects``, ``bytes_put``, ``bytes_got``,
        ``bytes_bounced`` (written or read through the bounce arena) and ``skipped`` (calls
        answered without the store: unhealthy, or the previous call still running)."""
        names = ("outages", "reconnects", "skipped", "bytes_put", "bytes_got", "bytes_bounced")
        return self.session.snapshot(names)

    def close(self) -> None:
        """Close the client once no call is running in it (never under one)."""
        self.session.close()


def _fence(late: list[Future]) -> Future[None] | None:
    """A future done once every one of ``late`` is (``None`` when there are none)."""
    if not late:
        return None
    fence: Future[None] = Future()
    left = [len(late)]
    lock = threading.Lock()

    def ended(_f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fence.set_result(None)

    for f in late:
        f.add_done_callback(ended)
    return fence


FIRST_PUT_BYTES = 4 << 20
"""Payload bytes staged before a batch's first put call leaves: digesting them takes a fraction
of a millisecond, and a smaller first call would pay a call's fixed cost for little."""


class _PutGroup:
    """Objects of one put call as staged: store names, (header slot, payload) pointers and
    sizes, payload and bounced bytes; ``fut`` once sent."""

    __slots__ = ("fut", "names", "nbytes", "ptrs", "sizes", "staged")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ptrs: list[list[int]] = []
        self.sizes: list[list[int]] = []
        self.nbytes = self.staged = 0
        self.fut: Future | None = None

    def add(self, name: str, head: int, payload: int, nbytes: int, bounced: int) -> None:
        self.names.append(name)
        self.ptrs.append([head, payload])
        self.sizes.append([HEADER_BYTES, nbytes])
        self.nbytes += nbytes
        self.staged += bounced

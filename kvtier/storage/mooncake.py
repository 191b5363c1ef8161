"""Mooncake Store L3 backend, ``MooncakeBackend``: page objects in a Mooncake distributed memory
pool. This module holds the storage contract (exists/get/set), health and probing; worker threads,
store error codes and the registered arenas are in ``kvtier.storage.mooncake_buffers``.

Configured by one string, ``CacheConfig.storage_url`` (format in ``kvtier.storage.mooncake_url``).
Objects are stored under ``kvtier/<namespace>/<key>`` as envelope header + payload, written and
read with the header in a registered arena and the payload straight from/to the caller's buffer
when that lies in memory given to ``register_buffers``. Reads verify the envelope and payload
crc; a failure is a miss counted by its kind and the object is removed (best effort).

Health: a store call that exceeds ``timeout_s`` or answers an RPC/transfer failure marks the
backend unhealthy (``outages``); calls then answer misses without touching the store, and one
probe runs in the background after a backoff of 0.5 s doubling to 10 s; its success marks the
backend healthy again (``reconnects``). Start-up never fails on an unreachable master: the backend
starts unhealthy, logs a warning naming the master, and connects on a later probe. After a master
restart the client reconnects by itself (the restarted master has lost every object). A read that
timed out still waits (bounded) for its call to end, because the library may still be writing
into the caller's buffers, which the caller frees as soon as the read returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import envelope
from kvtier.storage.base import StorageBackend, StorageCapabilities
from kvtier.storage.envelope import HEADER_BYTES, EnvelopeError
from kvtier.storage.mooncake_buffers import (
    MISSING,
    NO_SPACE,
    UNREACHABLE,
    TransferBuffers,
    Worker,
    bytes_view,
)
from kvtier.storage.mooncake_url import parse_storage_url

if TYPE_CHECKING:
    from kvtier.config import CacheConfig

log = logging.getLogger("kvtier.storage")

_BACKOFF = (0.5, 10.0)
_DRAIN_S = 35.0
"""How long a timed-out read may still write into its buffers: above the transfer engine's 30 s
no-progress limit."""


class MooncakeBackend(StorageBackend):
    """Objects in a Mooncake Store cluster, shared by every process connected to it.

    Thread-safe in the way kvtier uses backends: ``batch_get``/``batch_set`` from one thread,
    ``batch_exists`` from another (each has its own worker thread for store calls).
    """

    name = "mooncake"
    capabilities = StorageCapabilities(
        page_spans=True, zero_copy=True, persistent=False, shared_across_hosts=True
    )

    def __init__(self, storage_url: str, namespace: Namespace) -> None:
        """Parse ``storage_url`` and connect, waiting up to ``max(timeout_s, 5 s)``.

        Raises ``ConfigError`` for a malformed URL or when ``mooncake.store`` cannot be imported.
        """
        super().__init__()
        self.settings = parse_storage_url(storage_url)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConfigError(
                f"storage_url={storage_url!r} needs the Mooncake client (pip install "
                f"'kvtier[mooncake]', and the system library libibverbs1): {e}"
            ) from e
        self._store_cls = MooncakeDistributedStore
        self.namespace = namespace
        self._prefix = f"kvtier/{namespace}/"
        self._lock = threading.Lock()
        self._client: Any = None
        self._healthy = self._closed = self._probing = False
        self._probe_finished = threading.Event()
        self._backoff, self._next_probe = _BACKOFF[0], 0.0
        self._reason = "not connected yet"
        self._counts: Counter[str] = Counter()
        self._buffers = TransferBuffers(self.settings.bounce, lambda: self._client)
        self._data = Worker("kvtier-mooncake-data")
        self._meta = Worker("kvtier-mooncake-meta")
        fut = self._maybe_probe()
        if fut is not None:
            concurrent.futures.wait([fut], max(self.settings.timeout_s, 5.0))
        if not self._healthy:
            log.warning(
                "mooncake master %s not reachable at start-up (%s); L3 misses until it is",
                self.settings.master,
                self._reason,
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

    # ---- connection and health ------------------------------------------------------------
    def _connect(self) -> bool:
        s = self.settings
        meta = urllib.parse.urlsplit(s.metadata)
        targets = [s.master] + ([meta.netloc] if meta.scheme == "http" else [])
        for target in targets:
            host, _, port = target.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), s.timeout_s).close()
            except (OSError, ValueError) as e:
                self._reason = f"{target}: {e}"
                return False
        store = self._store_cls()
        rc = store.setup(*s.setup_args())
        if rc != 0:
            self._reason = f"setup returned {rc}"
            store.close()
            return False
        with self._buffers.lock:
            with self._lock:
                closed = self._closed
                if not closed:
                    self._client = store
            if closed:
                store.close()
                return False
            self._buffers.attach(store)
        return True

    def _probe(self) -> bool:
        client = self._client
        if client is None:
            return self._connect()
        codes = client.batch_is_exist([self._prefix + "probe"])
        self._reason = f"probe answered {codes[0]}"
        return codes[0] in (0, 1)

    def _maybe_probe(self) -> Future | None:
        with self._lock:
            if self._healthy or self._closed or self._probing:
                return None
            if time.monotonic() < self._next_probe:
                return None
            fut = self._meta.submit(self._probe)
            self._probing = fut is not None
        if fut is not None:
            fut.add_done_callback(self._probe_done)
        return fut

    def _probe_done(self, fut: Future) -> None:
        ok = fut.exception() is None and bool(fut.result())
        if fut.exception() is not None:
            self._reason = repr(fut.exception())
        with self._lock:
            self._probing = False
            if ok:
                if self._counts["connects"]:
                    self._counts["reconnects"] += 1
                self._counts["connects"] += 1
                self._healthy, self._backoff = True, _BACKOFF[0]
            else:
                self._next_probe = time.monotonic() + self._backoff
                self._backoff = min(2 * self._backoff, _BACKOFF[1])
        self._probe_finished.set()

    def wait_healthy(self, timeout_s: float) -> bool:
        """Probe (respecting the backoff) until the store answers or ``timeout_s`` passed;
        returns whether it is healthy. Waits only on probe results and backoff deadlines."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._healthy or self._closed:
                    return self._healthy and not self._closed
                next_probe = self._next_probe
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fut = self._maybe_probe()
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result(timeout=left)
                continue
            # A probe is running or the backoff has not expired: wait for whichever ends first.
            self._probe_finished.wait(min(left, max(next_probe - time.monotonic(), 0.001)))
            self._probe_finished.clear()

    def _outage(self, kind: str, message: str) -> None:
        self.fault(kind, f"{self.settings.master}: {message}")
        with self._lock:
            if self._healthy:
                self._healthy = False
                self._counts["outages"] += 1
                self._backoff = _BACKOFF[0]
                self._next_probe = time.monotonic() + self._backoff

    def _code_fault(self, code: int, what: str) -> None:
        """Count a negative store code that is not a plain miss."""
        if code in MISSING:
            return
        message = f"{what} answered {code}"
        if code in UNREACHABLE:
            self._outage("unreachable", message)
        else:
            self.fault("no_space" if code in NO_SPACE else "io", message)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def _ready(self) -> Any:
        """The client when calls may go to the store, else ``None`` (and maybe start a probe)."""
        with self._lock:
            client = self._client if self._healthy and not self._closed else None
        if client is None:
            self._count(skipped=1)
            self._maybe_probe()
        return client

    def _data_ready(
        self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]
    ) -> tuple[Any, list[np.ndarray]]:
        """``_ready`` for reading or writing ``buffers`` under ``keys``, with their byte views.
        Also needs the data worker idle: a call that outlived its timeout may still be using the
        header and bounce arenas."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        client = self._ready() if keys else None
        if client is not None and not self._data.wait_idle(0):
            self._count(skipped=1)
            client = None
        return client, ([] if client is None else [bytes_view(b) for b in buffers])

    def _submit(self, worker: Worker, fn: Callable[[], Any]) -> Future | None:
        fut = worker.submit(fn)
        if fut is None:
            self._count(skipped=1)
        return fut

    def _wait(self, fut: Future | None, what: str, drain: bool = False) -> Any:
        """The call's answer, or ``None`` after a timeout or exception (counted)."""
        if fut is None:
            return None
        try:
            return fut.result(timeout=self.settings.timeout_s)
        except concurrent.futures.TimeoutError:
            self._outage("timeout", f"{what} took over {self.settings.timeout_s} s")
            if drain and concurrent.futures.wait([fut], _DRAIN_S).not_done:
                log.error(
                    "mooncake %s still running after %s s; its buffers may change", what, _DRAIN_S
                )
        except Exception as e:  # noqa: BLE001 - a library fault is a miss, never a crash
            self.fault("io", f"{what}: {e!r}")
        return None

    # ---- data path ------------------------------------------------------------------------
    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register each contiguous CPU buffer once; reads and writes inside them skip the
        bounce arena."""
        self._buffers.register_buffers(buffers)

    def batch_exists(self, keys: Sequence[PageKey]) -> int:
        """Length of the leading run of ``keys`` present in the store (one batched call)."""
        client = self._ready() if keys else None
        if client is None:
            return 0
        names = [self._prefix + k for k in keys]
        codes = self._wait(self._submit(self._meta, lambda: client.batch_is_exist(names)), "exist")
        n = 0
        for code in codes or ():
            if code != 1:
                if code < 0:
                    self._code_fault(code, "batch_is_exist")
                break
            n += 1
        return n

    def batch_set(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Store ``buffers`` under ``keys`` in order; stops at the first fault (``timeout``,
        ``unreachable``, ``no_space``, ``io``). Keys already stored count as stored."""
        client, views = self._data_ready(keys, buffers)
        if client is None:
            return 0
        done, pending = 0, None
        for g, (rng, offs) in enumerate(self._buffers.plan(views)):
            names = [self._prefix + keys[i] for i in rng]
            heads = [
                envelope.pack(self.namespace, keys[i], views[i].nbytes, envelope.crc(views[i]))
                for i in rng
            ]
            ptrs, sizes, bounced = self._buffers.stage(g, rng, offs, views, heads)
            if bounced:
                self._count(bytes_bounced=bounced)
            if pending is not None:
                stored = self._put_done(*pending)
                done += stored
                if stored < len(pending[1]):
                    return done
            fut = self._submit(
                self._data,
                lambda n=names, p=ptrs, s=sizes: client.batch_put_from_multi_buffers(n, p, s),
            )
            pending = (fut, rng, views)
        return done + (self._put_done(*pending) if pending is not None else 0)

    def _put_done(self, fut: Future | None, rng: range, views: list[np.ndarray]) -> int:
        n = 0
        for code, i in zip(self._wait(fut, "put") or (), rng, strict=False):
            if code not in (0, -705):
                self._code_fault(code, "batch_put_from_multi_buffers")
                break
            n += 1
            self._count(bytes_put=views[i].nbytes)
        return n

    def batch_get(self, keys: Sequence[PageKey], buffers: Sequence[torch.Tensor]) -> int:
        """Read and verify objects into ``buffers`` in order; stops at the first miss or fault
        (``foreign``, ``format``, ``checksum``, ``short_read``, ``timeout``, ``unreachable``,
        ``io``). Objects that fail verification are removed from the store."""
        client, views = self._data_ready(keys, buffers)
        if client is None:
            return 0
        groups = self._buffers.plan(views)

        def submit(g: int) -> tuple[Future | None, list[np.ndarray]]:
            names = [self._prefix + keys[i] for i in groups[g][0]]
            ptrs, sizes, places = self._buffers.layout(g, *groups[g], views)
            fn = lambda: client.batch_get_into_multi_buffers(names, ptrs, sizes)  # noqa: E731
            return self._submit(self._data, fn), places

        done, bad = 0, []
        fut, places = submit(0)
        for g, (rng, _) in enumerate(groups):
            codes = self._wait(fut, "get", drain=True)
            if codes is None:
                break
            nxt = None
            if g + 1 < len(groups) and all(c >= 0 for c in codes):
                nxt = submit(g + 1)
            got = self._verify(g, rng, codes, keys, views, places, bad)
            done += got
            if got < len(rng) or nxt is None:
                if nxt is not None:
                    # Its bytes may still be landing in the caller's buffers.
                    self._wait(nxt[0], "get", drain=True)
                break
            fut, places = nxt
        for name in bad:
            self._wait(self._submit(self._data, lambda n=name: client.remove(n, True)), "remove")
        return done

    def _verify(
        self,
        g: int,
        rng: range,
        codes: list[int],
        keys: Sequence[PageKey],
        views: list[np.ndarray],
        places: list[np.ndarray],
        bad: list[str],
    ) -> int:
        n = 0
        for j, (i, code, place) in enumerate(zip(rng, codes, places, strict=True)):
            v, name = views[i], self._prefix + keys[i]
            try:
                if code in (-600, -800):
                    self._check_size(name, HEADER_BYTES + v.nbytes)
                if code < 0:
                    self._code_fault(code, "batch_get_into_multi_buffers")
                    return n
                head = self._buffers.header(g, j)[: min(code, HEADER_BYTES)].tobytes()
                length, want = envelope.unpack(head, self.namespace, keys[i])
                if code - HEADER_BYTES < length:
                    raise EnvelopeError("short_read", f"{code - HEADER_BYTES} of {length} B")
                if length != v.nbytes or code - HEADER_BYTES != length:
                    raise EnvelopeError("checksum", f"{length}-byte payload, buffer {v.nbytes}")
                if envelope.crc(place) != want:
                    raise EnvelopeError("checksum", "payload crc32 mismatch")
            except EnvelopeError as e:
                self.fault(e.kind, f"{name}: {e}")
                bad.append(name)
                return n
            if place is not v:
                v[:] = place
            n += 1
            self._count(bytes_got=v.nbytes, bytes_bounced=0 if place is v else v.nbytes)
        return n

    def _check_size(self, name: str, want: int) -> None:
        """Raise the envelope fault of an object whose size is not ``want`` bytes; the store
        answers such a read with the same codes as a buffer or transfer failure."""
        client = self._client
        fut = self._submit(self._data, lambda: client.get_size(name)) if client else None
        size = self._wait(fut, "get_size")
        if isinstance(size, int) and 0 <= size < want:
            raise EnvelopeError("short_read", f"{size}-byte object, expected {want}")
        if isinstance(size, int) and size > want:
            raise EnvelopeError("checksum", f"{size}-byte object, expected {want}")

    def stats(self) -> dict[str, float]:
        """``healthy`` (1/0), ``outages``, ``reconnects``, ``bytes_put``, ``bytes_got``,
        ``bytes_bounced`` (written or read through the bounce arena) and ``skipped`` (calls
        answered without the store: unhealthy, or the previous call still running)."""
        names = ("outages", "reconnects", "skipped", "bytes_put", "bytes_got", "bytes_bounced")
        with self._lock:
            out = {k: float(self._counts[k]) for k in names}
            out["healthy"] = float(self._healthy and not self._closed)
        return out

    def close(self) -> None:
        """Close the client once no call is running in it (never under one)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        idle = all(w.wait_idle(self.settings.timeout_s) for w in (self._data, self._meta))
        if client is not None and idle:
            client.close()
        elif client is not None:
            log.warning("mooncake client left open: a store call is still running")
        self._data.stop()
        self._meta.stop()

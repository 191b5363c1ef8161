"""The connection to a Mooncake Store cluster and its health, for ``MooncakeBackend``.

A store call that exceeds ``timeout_s`` or answers an RPC/transfer failure marks the session
unhealthy (``outages``); calls then get no client (misses, counted as ``skipped``) and one probe
runs in the background after a backoff of 0.5 s doubling to 10 s; its success marks the session
healthy again (``reconnects``). Waiting for a call is bounded by ``timeout_s``: a call that
outlives it is abandoned (it keeps its worker thread; later calls run on the others), and what it
may still write into is the backend's business (see ``kvtier.storage.mooncake``).
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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvtier.storage.mooncake_buffers import MISSING, NO_SPACE, UNREACHABLE, TransferBuffers, Worker
from kvtier.storage.mooncake_url import MooncakeSettings

log = logging.getLogger("kvtier.storage")

_BACKOFF = (0.5, 10.0)
DATA_CALLS = 3
"""Store data calls that may run at once: one in use plus two that may hang past their timeout
before further calls are skipped (each holds a worker thread and an arena)."""

FaultSink = Callable[[str, str], None]
"""``fault(kind, message)``: the backend's fault counter."""


class MooncakeSession:
    """One client of the store, its health state and the two worker pools calls run on
    (``data`` for gets and puts, at ``settings.poll_nice``; ``meta`` for existence checks and
    probes, at the process's priority)."""

    def __init__(
        self,
        settings: MooncakeSettings,
        store_cls: Any,
        probe_key: str,
        buffers: TransferBuffers,
        fault: FaultSink,
    ) -> None:
        self.settings = settings
        self._store_cls = store_cls
        self._probe_key = probe_key
        self.buffers = buffers
        self._fault = fault
        self._lock = threading.Lock()
        self.client: Any = None
        self._healthy = self._closed = self._probing = False
        self._probe_started = 0.0
        self._probe_finished = threading.Event()
        self._backoff, self._next_probe = _BACKOFF[0], 0.0
        self.reason = "not connected yet"
        self._counts: Counter[str] = Counter()
        # Data calls busy-poll for their whole transfer: they run below the process's priority.
        # Meta calls stay at it: the connection is set up on them, and the client's own threads
        # (transport, RPC) inherit the priority of the thread that starts them.
        self.data = Worker("kvtier-mooncake-data", DATA_CALLS, nice=settings.poll_nice)
        self.meta = Worker("kvtier-mooncake-meta", 2)

    def start(self, wait_s: float) -> bool:
        """First connection attempt, waiting up to ``wait_s``; returns whether it is healthy."""
        fut = self._maybe_probe()
        if fut is not None:
            concurrent.futures.wait([fut], wait_s)
        return self._healthy

    def _connect(self) -> bool:
        s = self.settings
        meta = urllib.parse.urlsplit(s.metadata)
        targets = [s.master] + ([meta.netloc] if meta.scheme == "http" else [])
        for target in targets:
            host, _, port = target.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), s.timeout_s).close()
            except (OSError, ValueError) as e:
                self.reason = f"{target}: {e}"
                return False
        store = self._store_cls()
        rc = store.setup(*s.setup_args())
        if rc != 0:
            self.reason = f"setup returned {rc}"
            store.close()
            return False
        with self.buffers.lock:
            with self._lock:
                closed = self._closed
                if not closed:
                    self.client = store
            if closed:
                store.close()
                return False
            self.buffers.attach(store)
        return True

    def _probe(self) -> bool:
        client = self.client
        if client is None:
            return self._connect()
        codes = client.batch_is_exist([self._probe_key])
        self.reason = f"probe answered {codes[0]}"
        return codes[0] in (0, 1)

    def _maybe_probe(self) -> Future | None:
        with self._lock:
            now = time.monotonic()
            # A probe that outlived its timeout is abandoned like any call: probe again.
            running = self._probing and now - self._probe_started < self.settings.timeout_s
            if self._healthy or self._closed or running or now < self._next_probe:
                return None
            fut = self.meta.submit(self._probe)
            self._probing, self._probe_started = fut is not None, now
        if fut is not None:
            fut.add_done_callback(self._probe_done)
        return fut

    def _probe_done(self, fut: Future) -> None:
        ok = fut.exception() is None and bool(fut.result())
        if fut.exception() is not None:
            self.reason = repr(fut.exception())
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

    def outage(self, kind: str, message: str) -> None:
        self._fault(kind, f"{self.settings.master}: {message}")
        with self._lock:
            if self._healthy:
                self._healthy = False
                self._counts["outages"] += 1
                self._backoff = _BACKOFF[0]
                self._next_probe = time.monotonic() + self._backoff

    def code_fault(self, code: int, what: str) -> None:
        """Count a negative store code that is not a plain miss."""
        if code in MISSING:
            return
        message = f"{what} answered {code}"
        if code in UNREACHABLE:
            self.outage("unreachable", message)
        else:
            self._fault("no_space" if code in NO_SPACE else "io", message)

    def count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def ready(self) -> Any:
        """The client when calls may go to the store, else ``None`` (and maybe start a probe)."""
        with self._lock:
            client = self.client if self._healthy and not self._closed else None
        if client is None:
            self.count(skipped=1)
            self._maybe_probe()
        return client

    def submit(self, worker: Worker, fn: Callable[[], Any]) -> Future | None:
        fut = worker.submit(fn)
        if fut is None:
            self.count(skipped=1)
        return fut

    def wait(self, fut: Future | None, what: str) -> Any:
        """The call's answer, or ``None`` after ``timeout_s`` or an exception (counted). A
        call that timed out is abandoned, not waited for: ``fut`` may still complete later."""
        if fut is None:
            return None
        try:
            return fut.result(timeout=self.settings.timeout_s)
        except concurrent.futures.TimeoutError:
            self.outage("timeout", f"{what} took over {self.settings.timeout_s} s")
        except Exception as e:  # noqa: BLE001 - a library fault is a miss, never a crash
            self._fault("io", f"{what}: {e!r}")
        return None

    def snapshot(self, names: tuple[str, ...]) -> dict[str, float]:
        """Counters ``names`` and ``healthy`` (1/0)."""
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
            client, self.client = self.client, None
        idle = all(w.wait_idle(self.settings.timeout_s) for w in (self.data, self.meta))
        if client is not None and idle:
            client.close()
        elif client is not None:
            log.warning("mooncake client left open: a store call is still running")
        self.data.stop()
        self.meta.stop()

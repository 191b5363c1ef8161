"""The engine thread: the one thread that touches ``LLM`` and its cache.

HTTP handlers hand it commands through a queue (add a request, cancel one, run a callable)
and get events back through a per-request ``deliver`` callback: ``accepted`` once the engine
took the request, ``tokens`` (streaming requests only: the ids each step produced and, when the
request asked for them, their ``TokenLogprob`` entries, else ``None``), then ``done`` (the
``RequestOutput``) or ``error`` (an ``APIError``). Between commands it runs
``LLM.step`` while requests are unfinished, so requests arriving while others decode join
the next step's batch (continuous batching as ``LLM.generate`` does it).

``stop`` ends unfinished requests, then closes the engine: in-flight transfers land and pending
storage writes are flushed, so a server restarted on the same L3 directory finds them; one
INFO line says what that took (``shutdown_summary``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.errors import RequestError
from kvtier.server.api_errors import APIError, overloaded, server_error, unavailable
from kvtier.server.load_cost import Ahead, LoadCost, predicted_prefill_s

if TYPE_CHECKING:
    from kvtier.engine import LLM, RequestOutput, SamplingParams
    from kvtier.server.prometheus import ServerMetrics

log = logging.getLogger("kvtier.server")

Deliver = Callable[[str, Any], None]
_STOP = object()
_IDLE_WAIT_S = 1.0
"""How long an idle engine waits for a command before refreshing its health figures."""
_IO_WAIT_S = 0.05
"""How long it waits while transfers are in flight before polling the cache for them."""
_HEALTH_EVERY_S = 0.2


@dataclass(slots=True, eq=False)
class Ticket:
    """One HTTP request's handle on its engine request."""

    prompt: list[int] | str
    params: SamplingParams
    deliver: Deliver
    stream: bool
    prompt_param: str = "prompt"
    """The request field an invalid prompt is reported under (``prompt`` or ``messages``)."""
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int | None = None
    sent: int = 0
    """Output tokens already delivered."""
    last_token: float | None = None
    cancelled: bool = False
    ahead: Ahead = Ahead()
    """Requests the server held when this one was submitted: handed to the engine thread or
    waiting there (before their prefill), and running."""
    taken: float = 0.0
    """When the engine took it (``perf_counter``): ``arrival`` plus the wait for the step
    under way, which is part of what the requests ahead cost."""

    @property
    def logprobs(self) -> bool:
        """The request asked for its tokens' log-probabilities."""
        return self.params.logprobs is not None


class EngineLoop:
    """Owns ``llm`` on a thread of its own once ``start`` ran (see the module docstring).

    ``max_queue`` bounds the requests that wait for the engine (handed over but not taken, or
    taken but not admitted by the scheduler): ``submit`` past it raises a 429 ``APIError``.
    ``degraded_window_s``: storage counts as degraded for this long after its last fault.
    """

    def __init__(
        self,
        llm: LLM,
        *,
        max_queue: int = 256,
        metrics: ServerMetrics | None = None,
        degraded_window_s: float = 30.0,
    ) -> None:
        self.llm = llm
        self.max_queue = max_queue
        self.metrics = metrics
        self.degraded_window_s = degraded_window_s
        self._q: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._waiting = 0
        self._running = 0
        self._live: dict[int, Ticket] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._health: dict[str, Any] = {"status": "starting"}
        self._errors_total = 0
        self._last_error: float | None = None
        self._health_at = 0.0
        self._load_cost = LoadCost()
        self._measured: dict[str, float] = self._rates()
        self.cancels = 0
        """Requests cancelled because their client went away (what tests wait on)."""
        self.shutdown_summary: str | None = None
        """What closing the engine did (``shutdown_summary``), once it closed."""

    # ---- any thread -----------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_health(force=True)
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: list[int] | str,
        params: SamplingParams,
        deliver: Deliver,
        *,
        stream: bool = False,
        prompt_param: str = "prompt",
    ) -> Ticket:
        """Queue a request; raises ``APIError`` 429 past ``max_queue``, 503 once stopped."""
        ticket = Ticket(prompt, params, deliver, stream, prompt_param)
        with self._lock:
            if self._stopped.is_set():
                raise unavailable("the server is shutting down")
            depth = self._pending + self._waiting
            if depth >= self.max_queue:
                if self.metrics is not None:
                    self.metrics.rejected.labels("overload").inc()
                raise overloaded(depth, self.max_queue)
            ticket.ahead = Ahead(self._pending + self._waiting, self._running)
            self._pending += 1
            self._q.put(("add", ticket))
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Abort ``ticket``'s request (its client went away); a no-op once it finished."""
        with self._lock:
            if ticket.cancelled:
                return
            ticket.cancelled = True
            self.cancels += 1
        self._q.put(("cancel", ticket))

    def call(self, fn: Callable[[LLM], Any]) -> Future:
        """Run ``fn(llm)`` on the engine thread between two steps; its result (or exception)
        comes back through the future. What tests and ``/metrics`` inspect the engine with."""
        fut: Future = Future()
        if self._stopped.is_set():
            fut.set_exception(unavailable("the server is shutting down"))
        else:
            self._q.put(("call", fn, fut))
        return fut

    def queue_depth(self) -> dict[str, int]:
        with self._lock:
            return {"queued": self._pending + self._waiting, "running": self._running}

    def health(self) -> dict[str, Any]:
        """``status``: ``ok``, ``degraded`` (storage faulted within ``degraded_window_s`` or
        its backend reports itself unhealthy; requests are still served), ``starting`` or
        ``stopped``; ``rates`` (:meth:`_rates`, and ``request_cost_s`` (a request ahead
        before its prefill), ``decode_cost_s`` (one running) and ``request_duration_s`` once
        ``LoadCost`` has estimates); ``storage`` (``None``
        without a storage tier): ``backend``, ``healthy`` (no fault within the window and the
        backend says it is), ``backend_healthy``,
        ``storage_errors`` (faults by kind since start, as the cache's ``stats()`` counts
        them), ``errors_total``, ``last_error_age_s`` and the backend's own figures
        (``bytes_used``, ``budget_bytes``, ``objects``, ... as it reports them); plus the
        queue depth."""
        with self._lock:
            h = dict(self._health)
        if self._stopped.is_set():
            h["status"] = "stopped"
        h.update(self.queue_depth())
        return h

    def stop(self, timeout: float | None = None) -> None:
        """End unfinished requests (their clients get 503), close the engine (pending storage
        writes land) and join the thread."""
        with self._lock:
            self._stopped.set()
        self._q.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._commands():
                if self.llm.has_unfinished() or self.llm.cache.in_flight():
                    self._step()
                self._publish()
        except Exception:  # noqa: BLE001 - logged; every waiting client still gets an answer
            log.exception("engine thread failed")
        finally:
            self._shutdown()

    def _commands(self) -> bool:
        """Handle queued commands (waiting for one when there is nothing to compute); False
        once told to stop."""
        if self.llm.has_unfinished():
            timeout = 0.0
        else:
            timeout = _IO_WAIT_S if self.llm.cache.in_flight() else _IDLE_WAIT_S
        try:
            cmd = self._q.get(timeout=timeout) if timeout else self._q.get_nowait()
        except queue.Empty:
            return True
        while cmd is not _STOP:
            self._handle(cmd)
            try:
                cmd = self._q.get_nowait()
            except queue.Empty:
                return True
        return False

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(cmd[1])
        elif kind == "cancel":
            t: Ticket = cmd[1]
            if t.request_id is not None and self._live.pop(t.request_id, None) is not None:
                self.llm.abort(t.request_id)
                self._count("abort")
        else:
            fn, fut = cmd[1], cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.llm))
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _add(self, t: Ticket) -> None:
        with self._lock:
            self._pending -= 1
            self._waiting += 1  # until this step's counts are published
        if t.cancelled:  # its client went away before the engine took it
            self._count("abort")
            return
        t.taken = time.perf_counter()
        try:
            t.request_id = self.llm.add_request(t.prompt, t.params)
        except RequestError as e:
            # the engine's two length refusals: the context length and the device pool
            too_long = "exceeds" in str(e) or "device pool has only" in str(e)
            code = "context_length_exceeded" if too_long else "invalid_value"
            self._send(t, "error", APIError(400, str(e), param=t.prompt_param, code=code))
            return
        self._live[t.request_id] = t
        self._send(t, "accepted", t.request_id)

    def _step(self) -> None:
        try:
            finished = self.llm.step()
        except Exception as e:  # noqa: BLE001 - the engine's bookkeeping may be broken now
            log.exception("engine step failed; failing its requests")
            err = server_error(f"engine step failed: {type(e).__name__}: {e}")
            for rid, t in list(self._live.items()):
                try:
                    self.llm.abort(rid)
                except Exception:  # noqa: BLE001
                    log.exception("abort of request %d after a failed step", rid)
                self._send(t, "error", err)
                self._count("error")
            self._live.clear()
            return
        now = time.perf_counter()
        done = {o.request_id for o in finished}
        for rid, t in self._live.items():
            if rid not in done:
                lps = self.llm.output_logprobs(rid, t.sent) if t.logprobs else None
                self._tokens(t, self.llm.output_ids(rid), now, lps)
        for out in finished:
            t = self._live.pop(out.request_id, None)
            if t is not None:
                self._finish(t, out, now)

    def _finish(self, t: Ticket, out: RequestOutput, now: float) -> None:
        lps = out.logprobs[t.sent :] if out.logprobs is not None else None
        self._tokens(t, out.output_ids, now, lps)
        self._count(out.finish_reason or "none")
        if out.ttft_s is not None and out.preemptions == 0:
            own = predicted_prefill_s(
                out.recomputed, out.cached_host, out.cached_storage, self._measured
            )
            decode = max(now - t.taken - out.ttft_s, 0.0)
            first_token = t.taken - t.arrival + out.ttft_s  # from its submission
            self._load_cost.observe(t.ahead, first_token - own, own + decode)
        if out.finish_reason == "error":
            self._send(t, "error", server_error(f"the request failed in the engine: {out.error}"))
        else:
            self._send(t, "done", out)

    def _tokens(self, t: Ticket, ids: list[int], now: float, lps: list | None = None) -> None:
        """Deliver ``ids[t.sent:]`` (``lps``: their log-probabilities, from ``t.sent`` on)."""
        new = ids[t.sent :]
        if not new:
            return
        if self.metrics is not None:
            if t.last_token is None:
                self.metrics.ttft.observe(now - t.arrival)
                gaps = len(new) - 1
            else:
                gaps = len(new)
            if gaps:
                # a step that produced several tokens spreads its time over them
                dt = (now - (t.last_token or t.arrival)) / len(new)
                for _ in range(gaps):
                    self.metrics.itl.observe(dt)
        t.last_token = now
        t.sent = len(ids)
        if t.stream:
            self._send(t, "tokens", (new, lps))

    def _send(self, t: Ticket, kind: str, payload: Any) -> None:
        try:
            t.deliver(kind, payload)
        except Exception:  # noqa: BLE001 - a client's event loop gone must not stop the engine
            log.debug("delivery to a closed client failed", exc_info=True)

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(reason).inc()

    def _publish(self) -> None:
        c = self.llm.counts()
        with self._lock:
            self._waiting, self._running = c["waiting"], c["running"]
        self._refresh_health()

    def _refresh_health(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._health_at < _HEALTH_EVERY_S:
            return
        self._health_at = now
        backend = self.llm.cache.storage
        self._measured = self._rates()
        rates: dict[str, float] = dict(self._measured)
        fitted = {
            "request_cost_s": self._load_cost.prefill_cost_s(),
            "decode_cost_s": self._load_cost.decode_cost_s(),
            "request_duration_s": self._load_cost.duration_s(),
        }
        rates.update({k: v for k, v in fitted.items() if v is not None})
        health: dict[str, Any] = {"status": "ok", "storage": None, "rates": rates}
        if backend is not None:
            # dict() of a Counter copies it in one step under the GIL: the I/O thread may
            # count a fault meanwhile without breaking the copy.
            errors = dict(backend.errors)
            total = sum(errors.values())
            if total > self._errors_total:
                self._errors_total, self._last_error = total, now
            figures = backend.stats()
            reported = figures.get("healthy", 1)
            recent = self._last_error is not None and now - self._last_error < (
                self.degraded_window_s
            )
            if recent or not reported:
                health["status"] = "degraded"
            health["storage"] = {
                "backend": backend.name,
                "healthy": not (recent or not reported),
                "backend_healthy": bool(reported),
                "storage_errors": errors,
                "errors_total": total,
                "last_error_age_s": None if self._last_error is None else now - self._last_error,
                **{k: v for k, v in figures.items() if k != "healthy"},
            }
        with self._lock:
            self._health = health

    def _rates(self) -> dict[str, float]:
        """The rates the cache measured (its priors until then), in tokens per second: prompt
        tokens computed, and tokens of KV loaded from host and read from storage (where those
        tiers exist). ``kvtier route`` prices its choice of instance with them, and with the
        costs fitted from them (``LoadCost``, added by the health refresh)."""
        cache = self.llm.cache
        st = cache.stats()
        rates = {"prefill_tokens_per_s": float(st["restore_prefill_tokens_per_s"])}
        if cache.host_pool is not None:
            per_token = cache.host_pool.page_bytes / cache.page_size
            rates["host_tokens_per_s"] = st["restore_load_bytes_per_s"] / per_token
            if cache.storage is not None:
                rates["storage_tokens_per_s"] = st["restore_storage_read_bytes_per_s"] / per_token
        return rates

    def _shutdown(self) -> None:
        self._stopped.set()
        err = unavailable("the server is shutting down")
        ended = len(self._live)
        for rid, t in list(self._live.items()):
            try:
                self.llm.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort of request %d at shutdown", rid)
            self._send(t, "error", err)
        self._live.clear()
        while True:  # commands that raced with stop get an answer too
            try:
                cmd = self._q.get_nowait()
            except queue.Empty:
                break
            if cmd is not _STOP and cmd[0] == "add":
                self._send(cmd[1], "error", err)
            elif cmd is not _STOP and cmd[0] == "call":
                cmd[2].set_exception(err)
        before = _flush_counts(self.llm)
        try:
            self.llm.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the engine failed")
            return
        self.shutdown_summary = shutdown_summary(ended, before, _flush_counts(self.llm))
        log.info("%s", self.shutdown_summary)


_FLUSHED = ("host_backup_pages", "storage_backup_pages", "storage_write_bytes")


def _flush_counts(llm: LLM) -> dict[str, int]:
    """The counters a close moves (backups landed, storage writes), read off the cache."""
    try:
        st = llm.cache.stats()
    except Exception:  # noqa: BLE001 - a summary must not hide the close
        log.debug("cache stats at shutdown failed", exc_info=True)
        return {}
    counts = {k: int(st.get(k, 0)) for k in _FLUSHED}
    counts["storage_objects"] = int(st.get("storage_objects", -1))
    return counts


def shutdown_summary(ended: int, before: dict[str, int], after: dict[str, int]) -> str:
    """One line: the requests a shutdown ended and what closing the cache drained (host
    backups and storage writes that were in flight and landed), from the counters read
    before and after the close."""
    from kvtier.server.sizing import format_bytes

    parts = [f"shut down: {ended} unfinished request(s) ended"]
    if before and after:
        host = after["host_backup_pages"] - before["host_backup_pages"]
        pages = after["storage_backup_pages"] - before["storage_backup_pages"]
        nbytes = after["storage_write_bytes"] - before["storage_write_bytes"]
        parts.append(
            f"at close {host} host backup page(s) and {pages} storage page write(s) "
            f"({format_bytes(nbytes)}) were in flight and landed"
        )
        if after["storage_objects"] >= 0:
            parts.append(f"storage holds {after['storage_objects']} object(s)")
    return "; ".join(parts)


def engine_state(llm: LLM) -> dict[str, Any]:
    """Run on the engine thread (``EngineLoop.call(engine_state)``): checks the cache's
    integrity and returns what a client that went away could have left behind: unfinished
    requests, pages held by requests, locked tree nodes, pool usage."""
    cache = llm.cache
    cache.check_integrity()
    st = cache.stats()
    return {
        **llm.counts(),
        "locked_nodes": sum(1 for n in cache.tree.nodes() if n.lock_ref),
        "device_pages_engine": st["device_pages_engine"],
        "device_pages_used": st["device_pages_used"],
        "host_pages_used": st["host_pages_used"],
        "in_flight": cache.in_flight(),
    }

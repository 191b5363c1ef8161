"""Continuous batching over ``TieredCache``: a waiting queue, a running set, and per step one
batch mixing new prefills with one decode token for every running request."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.engine.request import Request, Status
from kvtier.errors import CapacityError, IntegrityError

if TYPE_CHECKING:
    from kvtier.cache import Handle, LoadResult, TieredCache

log = logging.getLogger("kvtier.engine")

MAX_PREFETCH_TRIES = 4
"""Fetch attempts in a row that found no host room, after which a request whose stored prefix
finds none stops waiting (a fetch that took pages starts the count again)."""


@dataclass(slots=True)
class Work:
    """One sequence of a step's batch: compute ``tokens[num_computed : num_computed + num_new]``
    or, when ``draft`` is set, the request's last token followed by ``draft``."""

    req: Request
    num_new: int
    spec_k: int = 0
    """Speculative decoding: draft tokens to propose before this decode step's forward."""
    draft: list[int] = field(default_factory=list)
    """The proposed tokens the forward verifies (``num_new == 1 + len(draft)``)."""
    prefill: bool = False
    """An admitted request's uncached tokens (the engine reports them with the forward's time,
    ``TieredCache.record_prefill``)."""


class Scheduler:
    """Decides each step what runs; owns the requests' slot bookkeeping against the cache.

    A request's prefill covers everything after its longest cached prefix (matched on
    ``tokens[:-1]`` so at least one token is computed and yields logits). Decode grows a request
    one page at a time. When no page can be found for a running request, the most recently
    admitted one is preempted: its computed pages go into the cache (so re-admission can hit
    them) and it re-enters the front of the waiting queue.
    """

    def __init__(
        self,
        cache: TieredCache,
        max_running: int,
        max_prefill_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        overlap_loads: bool = True,
        speculative_tokens: int = 0,
    ) -> None:
        """``speculative_tokens``: draft tokens a greedy decode step proposes (0: none)."""
        self.cache = cache
        self.speculative_tokens = speculative_tokens
        self.overlap_loads = overlap_loads
        self.page_size = cache.page_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._epoch = 0
        """Counts releases of running requests (whose locks pin host and device pages)."""

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefetching(self) -> bool:
        return any(r.prefetch is not None for r in self.waiting)

    def prefetch_ops(self) -> list:
        """Storage fetches that waiting requests depend on."""
        return [r.prefetch for r in self.waiting if r.prefetch is not None]

    def add(self, req: Request) -> None:
        """Queue ``req`` and start pulling its storage-only prefix into host memory."""
        self._try_prefetch(req)
        self.waiting.append(req)

    def _try_prefetch(self, req: Request) -> None:
        """Start fetching what storage holds beyond ``req``'s cached prefix. What the host tier
        could not take is fetched when the request comes up for admission after running
        requests released pages (``_epoch``)."""
        m = self.cache.match(req.tokens[:-1])
        req.prefetch_epoch = self._epoch
        req.storage_wanted = m.storage_len
        if m.storage_len > 0:
            req.prefetch = self.cache.prefetch(m)
        # Only fruitless tries count: a fetch that took pages brought the request closer.
        req.prefetch_tries = 0 if req.prefetch is not None else req.prefetch_tries + 1

    def schedule(self) -> list[Work]:
        """This step's batch: one decode token per running request, then admitted prefills.

        Admission always makes progress or fails: when the head of the queue cannot get its
        pages, every finished fetch behind it is consumed (its locks released), so no waiting
        request pins pages the head needs; a queue that cannot move with nothing running and
        nothing in flight raises ``CapacityError``.
        """
        preempted = self._reserve_decode_slots()
        work = [Work(r, 1, self.spec_k(r)) for r in self.running]
        if not preempted:
            work += self._admit()
        if not work and not preempted and self.waiting and not self.prefetching():
            # Pages that in-flight transfers hold become evictable once those land; a try can
            # start more (write-back eviction copies first), each giving some page a host copy.
            for _ in range(self.cache.kv_buffers.num_pages + 1):
                self.cache.drain()
                self._epoch += 1  # what landed may have freed host room: fetches try again
                work = self._admit()
                if work or self.prefetching() or not self.cache.in_flight():
                    break
            if not work and not self.prefetching():
                raise CapacityError(self._stuck_message())
        return work

    def _stuck_message(self) -> str:
        head = self.waiting[0]
        st = self.cache.stats()
        return (
            f"{len(self.waiting)} request(s) wait but none can be admitted: request {head.id} "
            f"needs {-(-len(head.tokens) // self.page_size)} device pages; the pool has "
            f"{st['device_pages_total'] - st['device_pages_used']} free, "
            f"{st['device_pages_cached']} cached (locked or in flight), "
            f"{st['device_pages_engine']} held by the engine (running requests, and with CUDA "
            "graphs one padding page)"
        )

    def spec_k(self, req: Request) -> int:
        """Draft tokens ``req``'s next decode step proposes: ``speculative_tokens`` for greedy
        requests (sampled ones decode one token at a time), fewer near ``max_tokens`` so that
        a step never computes tokens the request cannot keep."""
        if not self.speculative_tokens or not req.params.argmax_only or req.logprobs is not None:
            return 0  # a draft is verified against the raw argmax, one row per token
        left = req.params.max_tokens - req.num_output - 1
        return max(0, min(self.speculative_tokens, left))

    def _reserve_decode_slots(self) -> bool:
        """Give every running request slots for its next decode step: its last token and,
        speculating, its ``spec_k`` draft tokens (whole pages, allocated at their position)."""
        preempted = False
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.locs is None:
                raise IntegrityError(f"request {req.id} runs without slots")
            need = len(req.tokens) + self.spec_k(req)
            if req.locs.numel() >= need:
                i += 1
                continue
            try:
                page = self.cache.alloc(need - req.locs.numel(), at=req.locs.numel())
            except CapacityError:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                continue
            req.locs = torch.cat((req.locs, page))
            i += 1
        return preempted

    def _release_finished_fetches(self) -> None:
        """Consume every finished fetch wherever its request waits: committed pages are no
        longer pinned by the fetch's lock, so a blocked head of the queue can evict them."""
        for req in self.waiting:
            if req.prefetch is not None and self.cache.prefetch_ready(req.prefetch):
                self._consume(req)

    def _consume(self, req: Request) -> None:
        self.cache.finish_prefetch(req.prefetch)
        req.prefetch = None

    def _wait_for_host(self, req: Request) -> bool:
        """Whether ``req``, whose stored prefix found no host room, waits for some rather than
        recomputing it: not under ``best_effort``, only while running requests, fetches or
        transfers in flight (backups whose host pages are pinned until they land) can still
        free room, and under ``timeout`` until ``prefetch_timeout_s`` after arrival."""
        policy = self.cache.config.prefetch_policy
        if policy == "best_effort" or not (
            self.running or self.prefetching() or self.cache.in_flight()
        ):
            return False
        if req.prefetch_tries > MAX_PREFETCH_TRIES:
            return False  # the host tier keeps being too full: recompute rather than starve
        deadline = req.arrival + self.cache.config.prefetch_timeout_s
        # A clock: every rank of a CP group must read it the same way.
        return policy == "wait_complete" or self.cache.agree(time.perf_counter() < deadline)

    def _admit(self) -> list[Work]:
        work: list[Work] = []
        budget = self.max_prefill_tokens
        for req in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            consumed = req.prefetch is not None
            if consumed:
                if not self.cache.prefetch_ready(req.prefetch):
                    continue  # its storage pages are still arriving; those behind may go first
                self._consume(req)
            retry = consumed or req.prefetch_epoch != self._epoch
            if req.storage_wanted and retry and not self.prefetching():
                # Storage held more than the host tier took when it was last tried (or the
                # fetch just landed), and pages may have been released since: fetch the rest
                # before admitting. One fetch at a time, in queue order: fetches racing for a
                # short host tier evict each other's pages before their requests get in.
                self._try_prefetch(req)
            if req.prefetch is not None or (req.storage_wanted and self._wait_for_host(req)):
                continue
            m = self.cache.match(req.tokens[:-1], probe_storage=False)
            if work and len(req.tokens) - m.cached_len > budget:
                break
            self.cache.lock(m.handle)
            # may return less than m.cached_len when L1 is short
            ld = self.cache.load(m, overlap=self.overlap_loads)
            num_new = len(req.tokens) - ld.locs.numel()
            try:
                own = self.cache.alloc(num_new, at=ld.locs.numel())
            except CapacityError:
                # First come, first served: the head waits for running requests to free
                # pages, and no finished fetch behind it keeps pages pinned meanwhile.
                self.cache.unlock(m.handle)
                self._release_finished_fetches()
                break
            self.waiting.remove(req)
            self._start(req, m.handle, ld, own)
            work.append(Work(req, num_new, prefill=True))
            budget -= num_new
        return work

    def _start(self, req: Request, handle: Handle, ld: LoadResult, own: torch.Tensor) -> None:
        cached = ld.locs.numel()
        req.locs = torch.cat((ld.locs, own)) if cached else own
        req.prefix_len = req.num_computed = cached
        req.handle = handle
        req.layer_events = ld.layer_events
        req.status = Status.RUNNING
        num_new = len(req.tokens) - cached
        req.recomputed += num_new  # the cache counts it with the forward (``Work.prefill``)
        if not req.admitted:
            req.admitted = True
            self.cache.record_hits(handle)
            req.cached_device = ld.device_tokens
            req.cached_host = ld.host_tokens
            req.cached_storage = ld.storage_tokens
        self.running.append(req)

    def _release(self, req: Request) -> None:
        """Hand the request's computed pages to the cache and drop its slots and lock."""
        if req.locs is None:
            raise IntegrityError(f"request {req.id} released without slots")
        self._epoch += 1  # its locks are gone: short fetches may find host room now
        ckpt = None
        if req.checkpoints:
            ckpt = torch.zeros(req.num_computed // self.page_size, dtype=torch.bool)
            ckpt[[j for j in req.checkpoints if j < ckpt.numel()]] = True
        self.cache.finish(
            req.tokens[: req.num_computed], req.locs, req.prefix_len, req.handle, ckpt
        )
        req.state, req.checkpoints = None, set()
        req.locs, req.handle = None, None
        req.num_computed = req.prefix_len = req.window_left = 0
        self.running.remove(req)

    def _leave_window(self, req: Request) -> None:
        """Give back the window rows of the pages the request's next query no longer reads
        (it reads ``(num_computed - window, num_computed]``): a window pool holds a running
        request's window, whatever its context length, plus the window before its prompt's
        last page boundary, where a request sharing the prompt resumes::

            [0, keep_lo)          given back once behind the running window
            [keep_lo, keep_hi)    kept: resuming at keep_hi (the prompt's last whole page
                                  before its last token) reads them
            [keep_hi, end)        given back once behind the running window
        """
        window = self.cache.window
        if not window or req.locs is None:
            return
        ps = self.page_size
        end = max(0, req.num_computed - window + 1) // ps * ps
        if end <= req.window_left:
            return
        keep_hi = (len(req.prompt) - 1) // ps * ps
        keep_lo = max(0, keep_hi - window + 1) // ps * ps
        for lo, hi in ((req.window_left, min(end, keep_lo)), (max(req.window_left, keep_hi), end)):
            if hi > lo:
                self.cache.release_window(req.locs[lo:hi])
        req.window_left = end

    def abort(self, req: Request, error: BaseException) -> Request:
        """Finish ``req`` with ``error``: its own pages are freed (nothing it computed is
        cached) and its lock released. Returns it."""
        log.warning("request %d failed: %s: %s", req.id, type(error).__name__, error)
        if req in self.running:
            req.num_computed = req.prefix_len  # hand back only the cache's own prefix
            self._release(req)
        elif req in self.waiting:
            self._leave_queue(req)
        req.status = Status.FINISHED
        req.finish_reason = "error"
        req.error = f"{type(error).__name__}: {error}"
        return req

    def cancel(self, req: Request) -> Request:
        """Finish ``req`` on its caller's behalf (``finish_reason="abort"``): a running request
        hands what it computed to the cache, as a preempted one does (its KV is valid), and
        drops its slots and lock; a waiting one leaves the queue, its fetch released (pages
        still in flight land and become visible at later polls). Returns it."""
        if req in self.running:
            self._release(req)
        elif req in self.waiting:
            self._leave_queue(req)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        return req

    def _leave_queue(self, req: Request) -> None:
        if req.prefetch is not None:
            self._consume(req)  # an unreleased fetch would keep its pages locked
        self.waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status = Status.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)

    def update(self, work: list[Work], next_tokens: list[list[int]]) -> list[Request]:
        """Record the step's new tokens (one per item, or a verified draft's accepted tokens
        plus the target's next one); returns the requests that finished. Tokens after a stop
        token, or after the token that completes a stop string, are dropped. Every computed token is kept: only the last new one is pending."""
        now = time.perf_counter()
        finished: list[Request] = []
        for w, toks in zip(work, next_tokens, strict=True):
            req = w.req
            if req.first_token_time is None:
                req.first_token_time = now
            p = req.params
            for tok in toks:
                req.tokens.append(tok)
                if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
                    req.finish_reason = "stop"
                    req.stop_reason = tok if tok in p.stop_token_ids else None
                elif req.stops is not None and req.stops.feed(tok):
                    req.finish_reason, req.stop_reason = "stop", req.stops.matched
                elif req.num_output >= p.max_tokens:
                    req.finish_reason = "length"
                else:
                    continue
                break
            # the item computed every token but the last new one (rejected drafts are not
            # counted: their rows are rewritten before anything reads them)
            req.num_computed = len(req.tokens) - 1
            req.trim_outputs()
            if req.finish_reason is None:
                self._leave_window(req)
                continue
            self._release(req)
            req.status = Status.FINISHED
            finished.append(req)
        return finished

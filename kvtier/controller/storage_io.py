"""L3 I/O off the scheduling thread: host → storage writes, storage → host reads of prefetches
and recency touches of stored objects a request used from another tier.

One background thread runs backend calls in submission order. ``StorageIO`` only submits
work and reaps it; it never changes tree state (the controller pins nodes before submitting
and records results after reaping, on the scheduling thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from kvtier.controller.records import PrefetchOp, Span, agree_all, finished, split_spans
from kvtier.errors import IntegrityError
from kvtier.keys import PageKey, state_key
from kvtier.metrics import Metrics
from kvtier.parallel.acks import shard_ready
from kvtier.parallel.group import Group, SoloGroup
from kvtier.parallel.layout import CPLayout
from kvtier.pools.host import HostPool
from kvtier.storage.base import StorageBackend
from kvtier.transfer.delays import CompletionDelays
from kvtier.transfer.objects import ObjectCodec
from kvtier.transfer.translate import PageTranslator
from kvtier.tree.node import Node

CHUNK_PAGES = 32
"""Pages per backend call of a prefetch: the granularity at which fetched pages become visible."""


@dataclass(slots=True, eq=False)
class WriteOp:
    """Host → storage write of several nodes' pages; each span's part is its range of keys."""

    spans: list[Span]
    keys: list[PageKey]
    pages: torch.Tensor
    ckpt: torch.Tensor | None
    future: Future | None = None
    started: float = field(default_factory=time.perf_counter)
    mine: int = -1
    """Under CP: how many of the pages are this rank's to write (-1: all of them)."""
    stored_here: int = 0
    """Under CP: how many of those this rank stored."""
    hold: int = -1
    """Test completion delay: reaps left before this write is seen done (-1: none)."""


@dataclass(slots=True, eq=False)
class TouchOp:
    """Recency refresh of stored page objects: one backend ``touch`` per range in ``runs`` (the
    keys of consecutive stored nodes of one path); each span's part is its range of ``keys``, so
    the objects found gone map back to the nodes holding them."""

    spans: list[Span] = field(default_factory=list)
    keys: list[PageKey] = field(default_factory=list)
    runs: list[range] = field(default_factory=list)
    future: Future | None = None
    hold: int = -1
    """Test completion delay: reaps left before this touch is seen done (-1: none)."""


class StorageIO:
    """Submits backend calls to one I/O thread and tracks them until reaped."""

    def __init__(
        self,
        backend: StorageBackend,
        host: HostPool,
        metrics: Metrics,
        page_tokens: int,
        translator: PageTranslator | None = None,
        layout: CPLayout | None = None,
        group: Group | None = None,
        delays: CompletionDelays | None = None,
    ) -> None:
        """With a CP ``layout`` this rank writes, reads and touches only the page objects it
        owns (objects are per logical page and do not name the rank, so any CP size reads
        them), and reaping agrees with the ``group``. ``delays`` (tests only) holds every
        completion back for a few reaps (``kvtier.transfer.delays``)."""
        self.backend = backend
        self.delays = delays or CompletionDelays()
        self.layout = layout
        self.group: Group = group or SoloGroup()
        self.host = host
        self.metrics = metrics
        self.page_tokens = page_tokens
        self.pages = ObjectCodec(host, [s for s in host.specs if not s.partial], translator)
        states = [s for s in host.specs if s.partial]
        self.states = ObjectCodec(host, states, translator) if states else None
        backend.register_buffers([b for b in host.buffers.values() if b.is_contiguous()])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-l3")
        self._writes: list[WriteOp] = []
        self._touch_next = TouchOp()
        self._touch_nodes: set[Node] = set()  # nodes in ``_touch_next`` (touched once a poll)
        self._touches: list[TouchOp] = []

    # ---- writes ---------------------------------------------------------------------------
    def write(self, nodes: list[Node], keys: list[list[PageKey]]) -> WriteOp:
        """Back up the host copies of ``nodes`` (the caller keeps them pinned until reaped)."""
        spans, flat, pages, ckpts, pos = [], [], [], [], 0
        for node, ks in zip(nodes, keys, strict=True):
            if node.host is None or (self.states is not None and node.ckpt is None):
                raise IntegrityError(f"storage write of {node!r}: no host copy or checkpoints")
            spans.append(Span(node, range(pos, pos + len(ks))))
            flat += ks
            pages.append(node.host)
            if self.states is not None:
                ckpts.append(node.ckpt)
            pos += len(ks)
        op = WriteOp(spans, flat, torch.cat(pages), torch.cat(ckpts) if ckpts else None)
        op.hold = self.delays.draw()
        op.future = self._pool.submit(self._do_write, op)
        self._writes.append(op)
        return op

    def _do_write(self, op: WriteOp) -> torch.Tensor:
        """Returns, per page, whether everything it needs is stored.

        A page object already present is skipped by the backend (counted as stored); its state
        object, where the checkpoint is valid, is still written, and the page counts as done
        only if that write succeeded.
        """
        t0 = time.perf_counter()
        n = len(op.keys)
        if self.layout is not None:
            # This rank's shard: the pages on its lane; the others are not its to write.
            done = torch.ones(n, dtype=torch.bool)
            mine = torch.nonzero(self.layout.owned_mask(op.pages)).reshape(-1)
            keys = [op.keys[i] for i in mine.tolist()]
            stored = 0
            if keys:  # a zero-owned shard: nothing to write, the op is still acknowledged
                bufs = self.pages.gather(len(keys), self.pages.slots(op.pages[mine]))
                stored = self.backend.batch_set(keys, bufs)
            done[mine[stored:]] = False
            op.mine, op.stored_here = len(keys), stored
            self.metrics.inc("storage_write_seconds", time.perf_counter() - t0)
            self.metrics.inc("storage_write_bytes", stored * self.pages.nbytes)
            return done
        stored = self.backend.batch_set(op.keys, self.pages.gather(n, self.pages.slots(op.pages)))
        done = torch.zeros(n, dtype=torch.bool)
        done[:stored] = True
        nbytes = stored * self.pages.nbytes
        if self.states is not None and op.ckpt is not None:
            idx = op.ckpt[:stored].nonzero().reshape(-1)
            if idx.numel():
                skeys = [state_key(op.keys[i]) for i in idx.tolist()]
                sp = op.pages[idx]
                ok = self.backend.batch_set(
                    skeys, self.states.gather(len(skeys), self.states.slots(sp))
                )
                done[idx[ok:]] = False
                nbytes += ok * self.states.nbytes
        self.metrics.inc("storage_write_seconds", time.perf_counter() - t0)
        self.metrics.inc("storage_write_bytes", nbytes)
        return done

    def reap_writes(self) -> list[tuple[Span, bool]]:
        """Spans of the finished writes, each with whether all its pages are now stored (the
        caller unpins the nodes and records that in the tree)."""
        out: list[tuple[Span, bool]] = []
        ops = finished(self._writes, self._landed, self.group)
        for op in ops:
            self._writes.remove(op)
            done = op.future.result()
            out += [(sp, bool(done[sp.part.start : sp.part.stop].all())) for sp in op.spans]
            complete, total = int(done.sum()), len(op.keys)
            if op.mine >= 0:  # count this rank's shard
                complete, total = op.stored_here, op.mine
            self.metrics.inc("storage_backup_pages", complete)
            self.metrics.inc("storage_backup_tokens", complete * self.page_tokens)
            if complete < total:
                self.metrics.inc("dropped_storage_backups", total - complete)
        # A node is stored only once every rank stored its shard of it.
        flags = agree_all([ok for _, ok in out], self.group)
        return [(sp, ok) for (sp, _), ok in zip(out, flags, strict=True)]

    def pinned(self) -> list[Span]:
        """Spans of the writes in flight (each pins its node's host copy once)."""
        return [sp for op in self._writes for sp in op.spans]

    # ---- recency --------------------------------------------------------------------------
    def queue_touch(self, path: list[Node], keys_of: Callable[[Node], list[PageKey]]) -> None:
        """Queue a touch of the stored nodes of ``path`` (keys from ``keys_of``) for the next
        ``flush_touches``: one backend call per run of consecutive stored nodes; nodes already
        queued are skipped."""
        op, start = self._touch_next, None
        for node in [*path, None]:
            if node is None or not node.in_storage or node in self._touch_nodes:
                if start is not None:
                    op.runs.append(range(start, len(op.keys)))
                    start = None
                continue
            ks = self._mine(node, keys_of(node))
            self._touch_nodes.add(node)
            start = len(op.keys) if start is None else start
            op.spans.append(Span(node, range(len(op.keys), len(op.keys) + len(ks))))
            op.keys += ks

    def flush_touches(self) -> None:
        """Send the queued touches to the I/O thread as one job."""
        op = self._touch_next
        if not op.spans:  # not ``keys``: a CP rank owning none of them still issues the op
            return
        self._touch_next, self._touch_nodes = TouchOp(), set()
        op.future = self._pool.submit(
            lambda: [self.backend.touch(op.keys[r.start : r.stop]) if r else 0 for r in op.runs]
        )
        op.hold = self.delays.draw()
        self._touches.append(op)

    def reap_touches(self) -> list[Node]:
        """Nodes (still in the tree) with an object that a finished touch found gone."""
        lost: list[bool] = []
        ops = finished(self._touches, self._landed, self.group)
        spans: list[Span] = []
        for op in ops:
            self._touches.remove(op)
            gone = [
                range(r.start + found, r.stop)
                for r, found in zip(op.runs, op.future.result(), strict=True)
                if found < len(r)
            ]
            for sp in op.spans:
                r = sp.part
                hit = any(max(r.start, g.start) < min(r.stop, g.stop) for g in gone)
                spans.append(sp)
                lost.append(hit)
        # Gone on any rank is gone: that rank's shard must be written again.
        kept = agree_all([not h for h in lost], self.group)
        return [sp.node for sp, k in zip(spans, kept, strict=True) if not k and sp.node.parent]

    def _landed(self, op: WriteOp | TouchOp) -> bool:
        """Whether a write or touch is seen done by this reap. Under a test delay it is not
        for ``op.hold`` reaps; then the reap waits for it, so it is seen done at that reap
        whatever the I/O thread's speed."""
        if op.future is None:
            return False
        if op.hold > 0:
            op.hold -= 1
            return False
        if op.hold == 0:
            wait([op.future])
        return op.future.done()

    # ---- prefetch -------------------------------------------------------------------------
    def read(self, op: PrefetchOp) -> None:
        """Submit the reads of ``op``'s keys into its pages (``op.future`` completes after)."""
        if self.delays.on:  # at least one sync: a poll never sees the I/O as it happens
            op.hold = self.delays.draw() + 1
        if op.keys:
            op.future = self._pool.submit(self._do_prefetch, op)
        else:
            op.future = Future()
            op.future.set_result(None)

    def _do_prefetch(self, op: PrefetchOp) -> None:
        t0 = time.perf_counter()
        total = len(op.keys)
        try:
            for lo in range(0, total, CHUNK_PAGES):
                if op.cancel:
                    return
                hi = min(lo + CHUNK_PAGES, total)
                got = self._read_mine(op.keys[lo:hi], op.pages[lo:hi], op)
                if self.states is not None and got:
                    got = self._read_states(op, lo, lo + got) - lo
                op.publish(lo + got)  # only after the bytes are in place
                if got < hi - lo:
                    return
        finally:
            self.metrics.inc("storage_read_seconds", time.perf_counter() - t0)

    def _read_mine(self, keys: list[PageKey], pages: torch.Tensor, op: PrefetchOp) -> int:
        """Read the page objects of this rank's shard of ``keys`` (all without CP); returns how
        many leading pages have nothing left to wait for here (``kvtier.parallel.acks``)."""
        if self.layout is None:
            return self._read(self.pages, keys, pages, op)
        owners = self.layout.lanes(pages).tolist()
        mine = [i for i, o in enumerate(owners) if o == self.layout.rank]
        got = self._read(self.pages, [keys[i] for i in mine], pages[mine], op) if mine else 0
        return shard_ready(self.layout.rank, owners, got)

    def _mine(self, node: Node, keys: list[PageKey]) -> list[PageKey]:
        """The keys of ``node``'s pages this rank owns (all of them without CP)."""
        if self.layout is None:
            return keys
        first = (node.depth_tokens() - len(node.tokens)) // self.page_tokens
        owners = self.layout.owners(first, first + len(keys))
        return [k for k, o in zip(keys, owners, strict=True) if o == self.layout.rank]

    def _read(
        self, codec: ObjectCodec, keys: list[PageKey], pages: torch.Tensor, op: PrefetchOp
    ) -> int:
        bufs, staged = codec.read_buffers(len(keys), codec.slots(pages))
        got = self.backend.batch_get(keys, bufs)
        fence = self.backend.read_fence() if got < len(keys) else None
        if fence is not None:
            op.fences.append(fence)
            if staged is not None:
                op.staging.append(staged)
        if staged is not None and got:
            codec.scatter(pages[:got], staged[:got])
        self.metrics.inc("storage_read_bytes", got * codec.nbytes)
        return got

    def _read_states(self, op: PrefetchOp, lo: int, hi: int) -> int:
        """Fetch the checkpoints that exist for pages ``[lo, hi)``; flag those that arrived.
        Returns where the pages that may be published end: before a page whose state read was
        abandoned, since it may still write into that page."""
        if self.states is None or op.ckpt is None:
            return hi
        for i in range(lo, hi):
            sk = state_key(op.keys[i])
            if not self.backend.batch_exists([sk]):
                continue
            fences = len(op.fences)
            if self._read(self.states, [sk], op.pages[i : i + 1], op):
                op.ckpt[i] = True
            elif len(op.fences) > fences:
                return i
        return hi

    # ---- bookkeeping ----------------------------------------------------------------------
    def on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        for op in (*self._writes, self._touch_next, *self._touches):
            split_spans(op.spans, prefix, suffix, n)
        if suffix in self._touch_nodes:
            self._touch_nodes.add(prefix)

    def wait_all(self) -> None:
        """Block until every write and touch submitted so far finished."""
        for op in [*self._writes, *self._touches]:
            op.hold = min(op.hold, 0)
            if op.future is not None:
                op.future.result()

    def close(self) -> None:
        """Let submitted calls finish (reads see ``cancel``), then release the backend."""
        self._pool.shutdown(wait=True)
        self.backend.close()

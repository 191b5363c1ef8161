"""Storage I/O off the scheduling thread: host → storage writes, storage → host prefetches and
recency touches of stored objects that a request used from another tier.

One background thread runs backend calls in submission order. The scheduling thread only
submits work and, in ``Controller.poll``, reaps it; tree state is touched on the scheduling
thread alone. In-flight work pins the host pages it reads (``host_io``) or owns the pages it
writes (freshly allocated, not yet in the tree).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.config import CacheConfig
from kvtier.keys import PageKey, state_key
from kvtier.metrics import Metrics
from kvtier.pools.host import HostPool
from kvtier.storage.base import StorageBackend
from kvtier.transfer.objects import ObjectCodec
from kvtier.tree.node import Node

CHUNK_PAGES = 32
"""Pages per backend call of a prefetch: the granularity at which fetched pages become visible."""


@dataclass(slots=True, eq=False)
class PrefetchOp:
    """Storage → host fetch of ``keys`` into ``pages``.

    ``prefix`` holds the tokens before the fetched range (from the root), ``tokens`` the range
    itself. ``anchor`` is the locked node ending at ``prefix``; it is ``None`` while ``prefix``
    is still being fetched by the ops in ``deps`` (in-flight fetches of the same pages are
    shared, not repeated) and is resolved when they have committed. The I/O thread advances
    ``done_pages`` after each verified chunk; the scheduling thread commits
    ``[committed_pages, done_pages)`` into the tree and moves the anchor down.
    """

    anchor: Node | None
    prefix: tuple[int, ...]
    tokens: tuple[int, ...]
    keys: list[PageKey]
    pages: torch.Tensor
    deadline: float
    deps: list[PrefetchOp] = field(default_factory=list)
    ckpt: torch.Tensor | None = None
    done_pages: int = 0
    committed_pages: int = 0
    released: bool = False
    closed: bool = False
    cancel: bool = False
    future: Future | None = None
    fences: list[Future] = field(default_factory=list)
    """``read_fence``s of short reads: until they are done an abandoned backend call may still
    write into pages past ``done_pages`` (or into ``staging``), so those stay allocated."""
    staging: list[torch.Tensor] = field(default_factory=list)

    def io_done(self) -> bool:
        return self.future is not None and self.future.done()

    def unfenced(self) -> bool:
        """Whether no abandoned read can still write into this fetch's buffers."""
        return all(f.done() for f in self.fences)

    def pending_futures(self) -> list[Future]:
        """I/O futures of this fetch and the fetches it waits on that are still running."""
        own = [self.future] if self.future is not None and not self.future.done() else []
        return own + [f for d in self.deps for f in d.pending_futures()]

    def ready(self, policy: str) -> bool:
        """Whether a request waiting on this fetch may proceed under ``policy``."""
        if policy == "best_effort":
            return True
        if self.io_done() and all(d.ready(policy) for d in self.deps):
            return True
        return policy == "timeout" and time.monotonic() >= self.deadline


@dataclass(slots=True, eq=False)
class WriteOp:
    """Host → storage write of several nodes' pages; entries are ``[node, range]`` into keys."""

    entries: list[list]
    keys: list[PageKey]
    pages: torch.Tensor
    ckpt: torch.Tensor | None
    future: Future | None = None
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True, eq=False)
class TouchOp:
    """Recency refresh of stored page objects: one backend ``touch`` per range in ``runs`` (the
    keys of consecutive stored nodes of one path); ``entries`` are ``[node, range]`` into
    ``keys``, so the objects found gone map back to the nodes holding them."""

    entries: list[list] = field(default_factory=list)
    keys: list[PageKey] = field(default_factory=list)
    runs: list[range] = field(default_factory=list)
    future: Future | None = None


class StorageIO:
    """Submits backend calls to one I/O thread and tracks them until reaped."""

    def __init__(
        self, backend: StorageBackend, host: HostPool, metrics: Metrics, page_tokens: int
    ) -> None:
        self.backend = backend
        self.host = host
        self.metrics = metrics
        self.page_tokens = page_tokens
        self.pages = ObjectCodec(host, [s for s in host.specs if s.token_indexed])
        states = [s for s in host.specs if not s.token_indexed]
        self.states = ObjectCodec(host, states) if states else None
        backend.register_buffers([b for b in host.buffers.values() if b.is_contiguous()])
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-l3")
        self._writes: list[WriteOp] = []
        self._prefetches: list[PrefetchOp] = []
        self._touch_next = TouchOp()
        self._touch_nodes: set[Node] = set()  # nodes in ``_touch_next`` (touched once a poll)
        self._touches: list[TouchOp] = []

    # ---- writes ---------------------------------------------------------------------------
    def write(self, nodes: list[Node], keys: list[list[PageKey]]) -> None:
        """Back up the host copies of ``nodes`` (pinned by ``host_io`` until reaped)."""
        entries, flat, pages, ckpts, pos = [], [], [], [], 0
        for node, ks in zip(nodes, keys, strict=True):
            assert node.host is not None
            node.host_io += 1
            entries.append([node, range(pos, pos + len(ks))])
            flat += ks
            pages.append(node.host)
            if self.states is not None:
                assert node.ckpt is not None
                ckpts.append(node.ckpt)
            pos += len(ks)
        op = WriteOp(entries, flat, torch.cat(pages), torch.cat(ckpts) if ckpts else None)
        op.future = self._pool.submit(self._do_write, op)
        self._writes.append(op)

    def _do_write(self, op: WriteOp) -> torch.Tensor:
        """Returns, per page, whether everything it needs is stored.

        A page object already present is skipped by the backend (counted as stored); its state
        object, where the checkpoint is valid, is still written, and the page counts as done
        only if that write succeeded.
        """
        t0 = time.perf_counter()
        n = len(op.keys)
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

    def reap_writes(self) -> list[Node]:
        """Unpin the host copies of finished writes; returns the nodes now wholly stored (the
        caller records that in the tree)."""
        stored: list[Node] = []
        for op in [w for w in self._writes if w.future is not None and w.future.done()]:
            self._writes.remove(op)
            done = op.future.result()
            for node, r in op.entries:
                node.host_io -= 1
                if bool(done[r.start : r.stop].all()):
                    stored.append(node)
            complete = int(done.sum())
            self.metrics.inc("storage_backup_pages", complete)
            self.metrics.inc("storage_backup_tokens", complete * self.page_tokens)
            if complete < len(op.keys):
                self.metrics.inc("dropped_storage_backups", len(op.keys) - complete)
        return stored

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
            ks = keys_of(node)
            self._touch_nodes.add(node)
            start = len(op.keys) if start is None else start
            op.entries.append([node, range(len(op.keys), len(op.keys) + len(ks))])
            op.keys += ks

    def flush_touches(self) -> None:
        """Send the queued touches to the I/O thread as one job."""
        op = self._touch_next
        if not op.keys:
            return
        self._touch_next, self._touch_nodes = TouchOp(), set()
        op.future = self._pool.submit(
            lambda: [self.backend.touch(op.keys[r.start : r.stop]) for r in op.runs]
        )
        self._touches.append(op)

    def reap_touches(self) -> list[Node]:
        """Nodes (still in the tree) with an object that a finished touch found gone."""
        lost: list[Node] = []
        for op in [t for t in self._touches if t.future is not None and t.future.done()]:
            self._touches.remove(op)
            gone = [
                range(r.start + found, r.stop)
                for r, found in zip(op.runs, op.future.result(), strict=True)
                if found < len(r)
            ]
            for node, r in op.entries:
                hit = any(max(r.start, g.start) < min(r.stop, g.stop) for g in gone)
                if hit and node.parent is not None:
                    lost.append(node)
        return lost

    # ---- prefetch -------------------------------------------------------------------------
    def prefetch(
        self,
        anchor: Node | None,
        prefix: tuple[int, ...],
        tokens: tuple[int, ...],
        keys: list[PageKey],
        pages: torch.Tensor,
        deps: list[PrefetchOp],
        config: CacheConfig,
    ) -> PrefetchOp:
        deadline = time.monotonic() + config.prefetch_timeout_s
        op = PrefetchOp(anchor, prefix, tokens, keys, pages, deadline, deps)
        if self.states is not None:
            op.ckpt = torch.zeros(len(keys), dtype=torch.bool)
        if keys:
            op.future = self._pool.submit(self._do_prefetch, op)
        else:
            op.future = Future()
            op.future.set_result(None)
        self._prefetches.append(op)
        return op

    def _do_prefetch(self, op: PrefetchOp) -> None:
        t0 = time.perf_counter()
        total = len(op.keys)
        try:
            for lo in range(0, total, CHUNK_PAGES):
                if op.cancel:
                    return
                hi = min(lo + CHUNK_PAGES, total)
                got = self._read(self.pages, op.keys[lo:hi], op.pages[lo:hi], op)
                if self.states is not None and got:
                    got = self._read_states(op, lo, lo + got) - lo
                op.done_pages = lo + got  # publish only after the bytes are in place
                if got < hi - lo:
                    return
        finally:
            self.metrics.inc("storage_read_seconds", time.perf_counter() - t0)

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

    def prefetches(self) -> list[PrefetchOp]:
        return list(self._prefetches)

    def forget(self, op: PrefetchOp) -> None:
        self._prefetches.remove(op)

    # ---- bookkeeping ----------------------------------------------------------------------
    def on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        for op in (*self._writes, self._touch_next, *self._touches):
            for i, (node, r) in enumerate(list(op.entries)):
                if node is suffix:
                    op.entries[i][1] = r[n:]
                    op.entries.append([prefix, r[:n]])
        if suffix in self._touch_nodes:
            self._touch_nodes.add(prefix)

    def pending_host_pages(self) -> int:
        """Host pages held by prefetches and not yet handed to the tree."""
        return sum(op.pages.numel() - op.committed_pages for op in self._prefetches)

    def wait_all(self) -> None:
        for op in [*self._writes, *self._prefetches, *self._touches]:
            if op.future is not None:
                op.future.result()

    def close(self) -> None:
        for op in self._prefetches:
            op.cancel = True
        self._pool.shutdown(wait=True)
        self.backend.close()

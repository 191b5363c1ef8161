"""Storage I/O off the scheduling thread: host → storage writes and storage → host prefetches.

One background thread runs backend calls in submission order. The scheduling thread only
submits work and, in ``Controller.poll``, reaps it; tree state is touched on the scheduling
thread alone. In-flight work pins the host pages it reads (``host_io``) or owns the pages it
writes (freshly allocated, not yet in the tree).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.config import CacheConfig
from kvtier.keys import PageKey
from kvtier.metrics import Metrics
from kvtier.pools.host import HostPool
from kvtier.storage.base import StorageBackend
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
    done_pages: int = 0
    committed_pages: int = 0
    released: bool = False
    closed: bool = False
    cancel: bool = False
    future: Future | None = None

    def io_done(self) -> bool:
        return self.future is not None and self.future.done()

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
    future: Future | None = None
    started: float = field(default_factory=time.perf_counter)


class StorageIO:
    """Submits backend calls to one I/O thread and tracks them until reaped."""

    def __init__(self, backend: StorageBackend, host: HostPool, metrics: Metrics) -> None:
        self.backend = backend
        self.host = host
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-l3")
        self._writes: list[WriteOp] = []
        self._prefetches: list[PrefetchOp] = []
        names = list(host.buffers)
        self._zero_copy = host.layout == "page_first" and len(names) == 1

    # ---- object buffers (one object = one page across all components) --------------------
    def _views(self, pages: torch.Tensor) -> list[torch.Tensor] | None:
        if not self._zero_copy:
            return None
        buf = next(iter(self.host.buffers.values()))
        return [buf[p].reshape(-1).view(torch.uint8) for p in pages.tolist()]

    def _gather(self, pages: torch.Tensor) -> list[torch.Tensor]:
        views = self._views(pages)
        if views is not None:
            return views
        parts = [
            self.host.read_pages(name, pages).reshape(pages.numel(), -1).view(torch.uint8)
            for name in self.host.buffers
        ]
        objs = torch.cat(parts, dim=1)
        return list(objs.unbind(0))

    def _staging(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.host.page_bytes), dtype=torch.uint8)

    def _scatter(self, pages: torch.Tensor, staged: torch.Tensor) -> None:
        off = 0
        for spec in self.host.specs:
            nb = spec.page_bytes(self.host.page_size)
            part = staged[:, off : off + nb].contiguous().view(spec.dtype)
            shape = (pages.numel(), spec.num_layers, self.host.page_size, *spec.row_shape)
            self.host.write_pages(spec.name, pages, part.view(shape))
            off += nb

    # ---- writes ---------------------------------------------------------------------------
    def write(self, nodes: list[Node], keys: list[list[PageKey]]) -> None:
        """Back up the host copies of ``nodes`` (pinned by ``host_io`` until reaped)."""
        entries, flat, pages, pos = [], [], [], 0
        for node, ks in zip(nodes, keys, strict=True):
            assert node.host is not None
            node.host_io += 1
            entries.append([node, range(pos, pos + len(ks))])
            flat += ks
            pages.append(node.host)
            pos += len(ks)
        op = WriteOp(entries, flat, torch.cat(pages))
        op.future = self._pool.submit(self._do_write, op)
        self._writes.append(op)

    def _do_write(self, op: WriteOp) -> int:
        t0 = time.perf_counter()
        n = self.backend.batch_set(op.keys, self._gather(op.pages))
        self.metrics.inc("storage_write_seconds", time.perf_counter() - t0)
        self.metrics.inc("storage_write_bytes", n * self.host.page_bytes)
        return n

    def reap_writes(self) -> None:
        for op in [w for w in self._writes if w.future is not None and w.future.done()]:
            self._writes.remove(op)
            stored = op.future.result()
            for node, r in op.entries:
                node.host_io -= 1
                if r.stop <= stored:
                    node.in_storage = True
            self.metrics.inc("storage_backup_pages", stored)
            if stored < len(op.keys):
                self.metrics.inc("dropped_storage_backups", len(op.keys) - stored)

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
                pages = op.pages[lo:hi]
                views = self._views(pages)
                staged = None if views is not None else self._staging(hi - lo)
                bufs = views if views is not None else list(staged.unbind(0))
                got = self.backend.batch_get(op.keys[lo:hi], bufs)
                if staged is not None and got:
                    self._scatter(pages[:got], staged[:got])
                self.metrics.inc("storage_read_bytes", got * self.host.page_bytes)
                op.done_pages = lo + got  # publish only after the bytes are in place
                if got < hi - lo:
                    return
        finally:
            self.metrics.inc("storage_read_seconds", time.perf_counter() - t0)

    def prefetches(self) -> list[PrefetchOp]:
        return list(self._prefetches)

    def forget(self, op: PrefetchOp) -> None:
        self._prefetches.remove(op)

    # ---- bookkeeping ----------------------------------------------------------------------
    def on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        for op in self._writes:
            for i, (node, r) in enumerate(list(op.entries)):
                if node is suffix:
                    op.entries[i][1] = r[n:]
                    op.entries.append([prefix, r[:n]])

    def pending_host_pages(self) -> int:
        """Host pages held by prefetches and not yet handed to the tree."""
        return sum(op.pages.numel() - op.committed_pages for op in self._prefetches)

    def wait_all(self) -> None:
        for op in [*self._writes, *self._prefetches]:
            if op.future is not None:
                op.future.result()

    def close(self) -> None:
        for op in self._prefetches:
            op.cancel = True
        self._pool.shutdown(wait=True)
        self.backend.close()

"""The ``Prefetcher``: every storage → host fetch, from start to close, and the map that
shares fetches of the same pages.

A fetch locks the node its pages hang below (its *anchor*) and owns freshly allocated host
pages; the I/O thread fills them chunk by chunk. At each poll the verified chunks are inserted
under the anchor, which moves down to their end (contract 3: nothing is matchable before its
bytes are verified). A request that stops waiting *releases* its fetch; the fetch *closes*
once its I/O ended: what never arrived is freed and the anchor unlocked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from kvtier.config import CacheConfig
from kvtier.controller.host_leases import HostLeases
from kvtier.controller.records import PrefetchOp
from kvtier.controller.staging import Staging
from kvtier.controller.storage_io import StorageIO
from kvtier.errors import IntegrityError
from kvtier.keys import PageKey
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group, SoloGroup
from kvtier.pools.host import HostPool
from kvtier.pools.host_arena import HostArena
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import Evicted, TreeMatch


class Prefetcher:
    """Owns every ``PrefetchOp`` and the dedupe map ``key → op`` of pages in flight."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTree,
        host: HostPool,
        io: StorageIO,
        alloc_host: Callable[[int, int], torch.Tensor | None],
        metrics: Metrics,
        owners: Callable[[int, int], list[int] | None] = lambda first, n: None,
        group: Group | None = None,
        staging: Staging | None = None,
    ) -> None:
        """``alloc_host(first, n)`` allocates host pages for sequence pages ``[first, first +
        n)`` (each on its owner's lane under CP, ``owners(first, n)``), evicting if needed.
        With ``staging`` (``host_mode='buffer_only'``) a fetch takes only what it admits."""
        self.staging = staging
        self.config = config
        self.tree = tree
        self.host = host
        self.io = io
        self._alloc_host = alloc_host
        self._owners = owners
        self.group: Group = group or SoloGroup()
        self.metrics = metrics
        self.ops: list[PrefetchOp] = []
        """Open fetches, oldest first."""
        self.leases = HostLeases(None)
        """The storage I/O's leases on a relocatable host pool (set by the controller): a
        fetch's pages are leased until committed or freed."""
        self.release_replaced: Callable[[Evicted], None] | None = None
        """Frees the pages of a partial tail a fetch replaced (set by the controller)."""
        self._fetching: dict[PageKey, PrefetchOp] = {}

    def start(
        self, match: TreeMatch, tokens: tuple[int, ...], keys: list[PageKey]
    ) -> PrefetchOp | None:
        """Fetch ``keys``, the pages of ``tokens[match.matched_len:][:len(keys) * page]``,
        below the matched prefix (locked here until the fetch closes). Leading pages another
        fetch already has in flight are waited for, not fetched again; a host tier short even
        after eviction fetches what fits."""
        ps = self.tree.page_size
        start = match.matched_len
        prefix, tokens = tokens[:start], tokens[start : start + len(keys) * ps]
        deps: list[PrefetchOp] = []
        j = 0
        while j < len(keys) and keys[j] in self._fetching:
            op = self._fetching[keys[j]]
            if op not in deps:
                deps.append(op)
            j += 1
        anchor: Node | None = None
        if j:  # the anchor is found when the pages before ours have been committed
            prefix, tokens, keys = prefix + tokens[: j * ps], tokens[j * ps :], keys[j:]
        else:  # locked before allocating: host eviction must not take the matched prefix
            anchor = self.tree.lock(match)
        first = len(prefix) // ps
        if self.staging is not None:  # the shorter-prefix fallback: what the buffer can stage
            n = self.staging.admit(len(keys))
            keys, tokens = keys[:n], tokens[: n * ps]
        pages = self._alloc_host(first, len(keys)) if keys else torch.empty(0, dtype=torch.int64)
        if pages is None:
            # Eviction already ran: take the leading pages whose lanes have room.
            alloc = self.host.allocator
            owners = self._owners(first, len(keys))
            fit = min(len(keys), alloc.available) if owners is None else alloc.fit(owners)
            pages = self._alloc_host(first, fit)
            if pages is None:
                raise IntegrityError("host allocator refused the pages it reported free")
            keys, tokens = keys[: pages.numel()], tokens[: pages.numel() * ps]
        if not keys and not deps:
            if anchor is not None:
                self.tree.unlock(anchor)
            return None
        deadline = time.monotonic() + self.config.prefetch_timeout_s
        op = PrefetchOp(anchor, prefix, tokens, keys, pages, deadline, deps)
        if self.io.states is not None:
            op.ckpt = torch.zeros(len(keys), dtype=torch.bool)
        self.leases.hold(pages)
        self.io.read(op)
        self.ops.append(op)
        for k in keys:
            self._fetching[k] = op
        return op

    def wait(self, ops: Sequence[PrefetchOp], timeout: float) -> None:
        """Block until one of ``ops`` (or a fetch it waits on) finished its I/O, a ``timeout``
        policy deadline passed, or ``timeout`` seconds elapsed."""
        futures: list[Future] = [f for op in ops for f in op.pending_futures()]
        if futures:
            soonest = min(op.deadline for op in ops) - time.monotonic()
            if self.config.prefetch_policy == "timeout":
                timeout = max(0.0, min(timeout, soonest))
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def commit(self, op: PrefetchOp) -> int:
        """Insert the pages ``op`` has verified so far below its anchor and move the anchor (a
        lock) to their end; returns how many tokens became newly visible."""
        ps = self.tree.page_size
        lo, hi = op.committed_pages, self._done(op)
        if hi <= lo or op.closed:
            return 0
        if op.anchor is None:
            tm = self.tree.match(op.prefix)
            if tm.matched_len < len(op.prefix):
                return 0  # the pages before ours are not in yet (or never will be)
            op.anchor = self.tree.lock(tm)
        out = self.tree.insert(
            op.tokens[lo * ps : hi * ps],
            op.pages[lo:hi],
            tier="host",
            keys=op.keys[lo:hi],
            start=op.anchor,
            checkpoints=op.ckpt[lo:hi] if op.ckpt is not None else None,
        )
        for node in out.taken:
            self.tree.set_origin(node, "storage")
        if out.dropped.device_pages or out.dropped.host_pages:
            # a partial tail the fetched pages run on past (``RadixTree.insert``)
            if self.release_replaced is None:
                raise IntegrityError("a fetch replaced a partial tail with nobody to free it")
            self.release_replaced(out.dropped)
        pages = op.pages[lo:hi]
        self.leases.drop(pages)  # verified: the I/O thread is done with them
        if out.duplicates.numel():
            self.host.allocator.free(out.duplicates)
        if isinstance(self.host, HostArena) and op.ckpt is not None:
            # Pages that came without window rows keep only their anchor's bytes.
            kept = ~torch.isin(pages, out.duplicates)
            self.host.release_window(pages[kept & ~op.ckpt[lo:hi]])
        self.tree.lock_node(out.last, hit=False)
        self.tree.unlock(op.anchor)
        op.anchor = out.last
        for k in op.keys[lo:hi]:
            self._fetching.pop(k, None)
        op.committed_pages = hi
        self.metrics.inc("prefetched_pages", hi - lo)
        return (hi - lo - out.duplicates.numel()) * ps

    def release(self, op: PrefetchOp) -> int:
        """The waiting request stops waiting: commit what arrived (``op``'s and the fetches it
        waits on); ``op`` closes now if its I/O is over, else at the poll that sees it end.
        Returns the tokens ``op`` itself made visible."""
        self._sync([*op.deps, op])
        for dep in op.deps:
            self.commit(dep)
        self.commit(op)
        op.released = True
        if self._settled(op) and not op.closed:
            self._close(op)
        # A partial tail page holds fewer tokens than a page: count the tokens themselves.
        return min(op.committed_pages * self.tree.page_size, len(op.tokens))

    def _close(self, op: PrefetchOp) -> None:
        """The I/O thread is done with ``op``: commit, free what never arrived, unlock."""
        self.commit(op)
        rest = op.pages[op.committed_pages :]
        if rest.numel():
            self.leases.drop(rest)  # settled: no read, late ones included, can reach them
            self.host.allocator.free(rest)
            self.metrics.inc("prefetch_failed_pages", rest.numel())
        for k in op.keys[op.committed_pages :]:
            self._fetching.pop(k, None)
        if op.anchor is not None:
            self.tree.unlock(op.anchor)
        op.closed = True
        self.ops.remove(op)

    @staticmethod
    def _local_settled(op: PrefetchOp) -> bool:
        """Whether ``op`` can close here: its I/O ended (no abandoned read can still write into
        its pages) and nothing it waits on can still commit."""
        return op.io_done() and op.unfenced() and all(d.closed for d in op.deps)

    def _settled(self, op: PrefetchOp) -> bool:
        return self._local_settled(op) if self.group.size == 1 else op.agreed_settled

    def _done(self, op: PrefetchOp) -> int:
        return op.done_pages if self.group.size == 1 else op.agreed_done

    def _sync(self, ops: list[PrefetchOp]) -> None:
        """CP group: agree on what ``ops`` fetched and whether they can close, so that every
        rank commits the same pages (only what every rank verified its shard of) and closes
        the same fetches. The I/O thread moves on meanwhile; what it adds is seen next sync.
        Every sync counts down the fetches' test completion delays (``PrefetchOp.tick``)."""
        for op in ops:
            op.tick()
        if self.group.size == 1 or not ops:
            return
        # Settled before done: pages counted after the I/O ended are final on that rank.
        settled = [1 if self._local_settled(op) else 0 for op in ops]
        done = [op.done_pages for op in ops]
        agreed = self.group.all_reduce_min_many(settled + done)
        for i, op in enumerate(ops):
            op.agreed_settled = agreed[i] == 1
            op.agreed_done = agreed[len(ops) + i]

    def poll(self) -> None:
        """Commit what arrived; close released fetches whose I/O ended."""
        self._sync(self.ops)
        for op in list(self.ops):
            self.commit(op)
            if op.released and self._settled(op):
                self._close(op)

    def queued_pages(self) -> int:
        """Storage pages the open fetches have still to read: what a new fetch waits behind on
        the one I/O thread (``kvtier.controller.restore_cost`` prices it)."""
        return sum(len(op.keys) - op.done_pages for op in self.ops if not op.io_done())

    def pending_host_pages(self) -> int:
        """Host pages held by fetches and not yet handed to the tree."""
        return sum(op.pages.numel() - op.committed_pages for op in self.ops)

    def wait_all(self) -> None:
        for op in list(self.ops):
            op.tick(force=True)
            if op.future is not None:
                op.future.result()

    def cancel_all(self) -> None:
        """Ask the I/O thread to stop reading for every open fetch (at close)."""
        for op in self.ops:
            op.cancel = True

    def check_integrity(self) -> None:
        """Every key in the dedupe map belongs to an open fetch, past what it committed."""
        for key, op in self._fetching.items():
            if op.closed or key not in op.keys[op.committed_pages :]:
                raise IntegrityError(f"prefetch map: key {key} points at a closed or done fetch")

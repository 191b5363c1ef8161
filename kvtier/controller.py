"""Moves pages between tiers and decides when copies become visible.

Every transfer is an in-flight record; ``poll`` completes the finished ones and only then makes
their copies visible to ``match`` (contract 3):

    device → host   backup        visible at poll after the copy's event completed
    host → device   load-back     the compute stream waits for the copy before any kernel reads
    host → storage  write         the key exists only after the backend's atomic write
    storage → host  prefetch      pages enter the tree in whole verified chunks, in order

In-flight work pins what it reads (``device_io``/``host_io``), so eviction never frees memory
under a transfer; splits re-attribute in-flight entries (the tree's split hook).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.config import CacheConfig
from kvtier.keys import Namespace, PageKey
from kvtier.metrics import Metrics
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.prefetch import PrefetchOp, StorageIO
from kvtier.storage.base import StorageBackend
from kvtier.transfer.mover import Mover
from kvtier.transfer.op import TransferOp
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import Evicted

Entry = list  # [node, payload]: payload is the node's slice of the op's pages (or None)


def split_entries(entries: list[Entry], prefix: Node, suffix: Node, n: int) -> None:
    """Re-attribute an in-flight op's entries after ``suffix`` lost its first ``n`` pages."""
    for i, (node, payload) in enumerate(list(entries)):
        if node is suffix:
            head = payload[:n] if payload is not None else None
            entries[i][1] = payload[n:] if payload is not None else None
            entries.append([prefix, head])


@dataclass(slots=True)
class InFlight:
    """A transfer in flight: the op plus which nodes it covers."""

    op: TransferOp
    entries: list[Entry]
    started: float = field(default_factory=time.perf_counter)


class Controller:
    """Owns the pools, the mover and the storage I/O; the tree is shared with the facade."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTree,
        device_pool: DevicePool,
        host_pool: HostPool | None,
        storage: StorageBackend | None,
        namespace: Namespace,
        metrics: Metrics,
    ) -> None:
        self.config = config
        self.tree = tree
        self.dev = device_pool
        self.host = host_pool
        self.namespace = namespace
        self.metrics = metrics
        self.mover = (
            Mover(
                device_pool,
                host_pool,
                debug_checks=config.debug_checks,
                backup_share=config.backup_share,
            )
            if host_pool
            else None
        )
        self.io: StorageIO | None = None
        if storage is not None and host_pool is not None:
            self.attach_storage(storage)
        self._fetching: dict[PageKey, PrefetchOp] = {}
        self._backups: list[InFlight] = []
        self._loads: list[InFlight] = []
        tree.split_hooks.append(self._on_split)

    def attach_storage(self, storage: StorageBackend) -> None:
        assert self.host is not None
        self.io = StorageIO(storage, self.host, self.metrics, self.tree.page_size)

    # ---- allocation with eviction --------------------------------------------------------
    def alloc_device(self, n: int) -> torch.Tensor | None:
        """``n`` device pages, evicting unlocked cached pages if needed; ``None`` if impossible."""
        short = n - self.dev.allocator.available
        if short > 0:
            self.evict_device(short)
        return self.dev.alloc_pages(n)

    def alloc_host(self, n: int) -> torch.Tensor | None:
        assert self.host is not None
        short = n - self.host.allocator.available
        if short > 0:
            self.evict_host(short)
        return self.host.allocator.alloc(n)

    def evict_device(self, n: int) -> int:
        prepare = self._backup_before_evict if self.config.write_policy == "write_back" else None
        ev = self.tree.evict_device(n, prepare)
        self._release(ev)
        return ev.num_device()

    def evict_host(self, n: int) -> int:
        ev = self.tree.evict_host(n)
        self._release(ev)
        return ev.num_host()

    def _release(self, ev: Evicted) -> None:
        for p in ev.device_pages:
            self.dev.free_pages(p)
        if ev.device_pages:
            self.metrics.inc("evicted_device_pages", ev.num_device())
        if self.host is not None:
            for p in ev.host_pages:
                self.host.allocator.free(p)
            if ev.host_pages:
                self.metrics.inc("evicted_host_pages", ev.num_host())

    def _backup_before_evict(self, node: Node) -> bool:
        """write_back: give ``node`` a host copy before its device copy goes."""
        if not node.on_host:
            flight = self.backup_to_host([node])
            if flight is not None:
                flight.op.wait()
                self._finish_backup(flight)
        return True

    # ---- device → host ------------------------------------------------------------------
    def backup_to_host(self, nodes: list[Node]) -> InFlight | None:
        """Start one batched copy giving ``nodes`` host copies (skips ones that have or are
        getting one). A full host tier drops the backup (counted), never blocks."""
        if self.mover is None:
            return None
        todo = [n for n in nodes if n.on_device and not n.on_host and not n.device_io]
        entries: list[Entry] = []
        for node in todo:
            assert node.device is not None
            pages = self.alloc_host(node.device.numel())
            if pages is None:
                self.metrics.inc("dropped_host_backups", node.device.numel())
                continue
            node.device_io += 1
            entries.append([node, pages])
        if not entries:
            return None
        dev = torch.cat([e[0].device for e in entries])
        host = torch.cat([e[1] for e in entries])
        flight = InFlight(self.mover.device_to_host(dev, host), entries)
        self._backups.append(flight)
        return flight

    def on_insert(self, nodes: list[Node]) -> None:
        """``nodes`` just took device pages from the engine (``write_through`` backs them up)."""
        if self.config.write_policy == "write_through":
            self.backup_to_host(nodes)

    def _finish_backup(self, flight: InFlight) -> None:
        flight.op.complete()
        if flight in self._backups:
            self._backups.remove(flight)
        stored: list[Node] = []
        assert self.host is not None
        for node, pages in flight.entries:
            node.device_io -= 1
            if node.host is None and node.parent is not None:
                self.tree.set_host(node, pages)
                stored.append(node)
            else:
                self.host.allocator.free(pages)
        self.metrics.inc("host_backup_pages", flight.op.num_pages)
        self.metrics.inc("backup_bytes", flight.op.nbytes)
        self.metrics.inc("backup_seconds", time.perf_counter() - flight.started)
        self.backup_to_storage(stored)

    # ---- host → device ------------------------------------------------------------------
    def load_back(self, path: list[Node], overlap: bool = False) -> tuple[int, list | None]:
        """Give the host-only nodes of a locked ``path`` device copies, in path order.

        Stops at the first node that does not fit; returns how many leading nodes of ``path``
        are now device-resident, and with ``overlap`` the per-layer arrival events of the copy
        (``None`` when nothing was copied or the copy completes before compute anyway).
        """
        entries: list[Entry] = []
        loaded = 0
        for node in path:
            if node.on_device:
                loaded += 1
                continue
            assert node.host is not None
            pages = self.alloc_device(node.host.numel())
            if pages is None:
                break
            entries.append([node, node.host])
            self.tree.set_device(node, pages)
            node.host_io += 1
            loaded += 1
        if entries:
            assert self.mover is not None
            host = torch.cat([e[1] for e in entries])
            dev = torch.cat([e[0].device for e in entries])
            op = self.mover.host_to_device(host, dev, overlap=overlap)
            self._loads.append(InFlight(op, [[e[0], None] for e in entries]))
            return loaded, op.layer_events
        return loaded, None

    def _finish_load(self, flight: InFlight) -> None:
        flight.op.complete()
        for node, _ in flight.entries:
            node.host_io -= 1
        self.metrics.inc("load_bytes", flight.op.nbytes)
        self.metrics.inc("load_seconds", time.perf_counter() - flight.started)

    # ---- host → storage -----------------------------------------------------------------
    def backup_to_storage(self, nodes: list[Node]) -> None:
        if self.io is None:
            return
        todo = [
            n
            for n in nodes
            if n.on_host and not n.in_storage and not n.host_io and n.parent is not None
        ]
        if todo:
            keys = [self.tree.ensure_keys(n, self.namespace) for n in todo]
            self.io.write(todo, keys)

    def touch_storage(self, path: list[Node]) -> None:
        """A request locked ``path``: refresh the storage recency of its stored nodes (a hit at
        any tier is a use of their objects) on the I/O thread, batched until the next poll."""
        if self.io is not None:
            self.io.queue_touch(path, lambda n: self.tree.ensure_keys(n, self.namespace))

    # ---- storage → host -----------------------------------------------------------------
    def start_prefetch(
        self, anchor: Node, prefix: tuple[int, ...], tokens: tuple[int, ...], keys: list[PageKey]
    ) -> PrefetchOp | None:
        """Fetch ``keys`` (the pages of ``tokens``, right after ``prefix`` which ends at the
        locked ``anchor``) into the host tier. Leading pages another fetch already has in
        flight are waited for, not fetched again. Takes over the anchor lock."""
        assert self.io is not None and self.host is not None
        ps = self.tree.page_size
        deps: list[PrefetchOp] = []
        j = 0
        while j < len(keys) and keys[j] in self._fetching:
            op = self._fetching[keys[j]]
            if op not in deps:
                deps.append(op)
            j += 1
        if j:
            self.tree.unlock(anchor)
            anchor = None
            prefix, tokens, keys = prefix + tokens[: j * ps], tokens[j * ps :], keys[j:]
        pages = self.alloc_host(len(keys)) if keys else torch.empty(0, dtype=torch.int64)
        if pages is None:  # host tier short even after eviction: fetch what fits
            pages = self.host.allocator.alloc(min(len(keys), self.host.allocator.available))
            assert pages is not None
            keys, tokens = keys[: pages.numel()], tokens[: pages.numel() * ps]
        if not keys and not deps:
            if anchor is not None:
                self.tree.unlock(anchor)
            return None
        op = self.io.prefetch(anchor, prefix, tokens, keys, pages, deps, self.config)
        for k in keys:
            self._fetching[k] = op
        return op

    def commit_prefetch(self, op: PrefetchOp) -> int:
        """Insert the pages ``op`` has verified so far below its anchor and move the anchor (a
        lock) to their end; returns how many tokens became newly visible."""
        assert self.host is not None
        ps = self.tree.page_size
        lo, hi = op.committed_pages, op.done_pages
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
            node.fetched = True
        if out.duplicates.numel():
            self.host.allocator.free(out.duplicates)
        self.tree.lock_node(out.last, hit=False)
        self.tree.unlock(op.anchor)
        op.anchor = out.last
        for k in op.keys[lo:hi]:
            self._fetching.pop(k, None)
        op.committed_pages = hi
        self.metrics.inc("prefetched_pages", hi - lo)
        return (hi - lo - out.duplicates.numel()) * ps

    def release_prefetch(self, op: PrefetchOp) -> None:
        """The waiting request stops waiting: commit what arrived (``op``'s and the fetches it
        waits on); ``op`` closes now if its I/O is over, else at the poll that sees it end."""
        for dep in op.deps:
            self.commit_prefetch(dep)
        self.commit_prefetch(op)
        op.released = True
        if self._settled(op) and not op.closed:
            self._close_prefetch(op)

    def _close_prefetch(self, op: PrefetchOp) -> None:
        """The I/O thread is done with ``op``: commit, free what never arrived, unlock."""
        assert self.host is not None and self.io is not None
        self.commit_prefetch(op)
        rest = op.pages[op.committed_pages :]
        if rest.numel():
            self.host.allocator.free(rest)
            self.metrics.inc("prefetch_failed_pages", rest.numel())
        for k in op.keys[op.committed_pages :]:
            self._fetching.pop(k, None)
        if op.anchor is not None:
            self.tree.unlock(op.anchor)
        op.closed = True
        self.io.forget(op)

    def _settled(self, op: PrefetchOp) -> bool:
        """Whether ``op`` can close: its I/O ended (no abandoned read can still write into its
        pages) and nothing it waits on can still commit."""
        return op.io_done() and op.unfenced() and all(d.closed for d in op.deps)

    # ---- progress -----------------------------------------------------------------------
    def poll(self) -> None:
        """Queue paced backup chunks, complete finished transfers and make their copies
        visible. Never blocks."""
        if self.mover is not None:
            self.mover.pump()
        for flight in [f for f in self._backups if f.op.done()]:
            self._finish_backup(flight)
        for flight in [f for f in self._loads if f.op.done()]:
            self._loads.remove(flight)
            self._finish_load(flight)
        if self.io is not None:
            for node in self.io.reap_writes():
                self.tree.set_in_storage(node, True)
            lost = self.io.reap_touches()
            for node in lost:
                self.tree.set_in_storage(node, False)
            self.backup_to_storage(lost)  # their objects are gone: write them again
            self.io.flush_touches()
            for op in self.io.prefetches():
                self.commit_prefetch(op)
                if op.released and self._settled(op):
                    self._close_prefetch(op)

    def drain(self, on_progress: Callable[[], None] | None = None) -> None:
        """Block until every in-flight transfer and storage write completed and is visible."""
        for flight in list(self._backups):
            flight.op.wait()
        for flight in list(self._loads):
            flight.op.wait()
        self.poll()
        if self.io is not None:
            self.io.wait_all()
        self.poll()
        if on_progress is not None:
            on_progress()

    def _on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        for flight in (*self._backups, *self._loads):
            split_entries(flight.entries, prefix, suffix, n)
        if self.io is not None:
            self.io.on_split(prefix, suffix, n)

    def inflight_host_pages(self) -> int:
        """Host pages owned by in-flight work rather than by the tree."""
        n = sum(e[1].numel() for f in self._backups for e in f.entries)
        return n + (self.io.pending_host_pages() if self.io is not None else 0)

    def close(self) -> None:
        self.drain()
        if self.mover is not None:
            self.mover.close()
        if self.io is not None:
            self.io.close()

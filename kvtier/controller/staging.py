"""``host_mode='buffer_only'``: the host tier as a staging buffer between device and storage.

Writes: device → host → storage. A node to back up waits in ``waiting`` (pinning its device
copy, ``device_io``) until host pages are free; it is copied in chunks of what the pool has,
split on page boundaries (``RadixTree.split``; unlocked nodes only), so a request larger than
the whole host pool still reaches storage across polls. Once a chunk's storage write is reaped its host copy is
freed at once; a write storage refused (store full, fault) drops the host copy too (counted in
``dropped_pages``), so no host page outlives the write it stages. A host copy with a write in
flight is pinned (``host_io``), so eviction never takes a page not yet stored.

Reads: storage → host → device. A fetch takes only pages that are free or reclaimable now
(``admit``); a fetched copy is freed once its load to device completed. A fetched copy no
load used (its request gave up) is an unlocked, idle, stored host copy: reclaimable, taken by
the next allocation that needs room.

Write reserve: while backups wait for room, a fetch leaves ``min(waiting bytes, pool bytes //
2)`` free for them. Backups are the only way pages reach storage and fetches the only way they
come back; the cap keeps half the pool for fetches so that neither side can starve the other.

Room is counted in bytes. With a fixed host pool every page costs the same (``page_bytes``);
with a relocatable host arena (``host_compaction``) the window rows are shared room: a backup of
a page whose device copy has no window rows takes only its anchor's bytes, and a fetch takes a
whole page until it knows (its pages without window rows give them back once committed).

Release rule: a host copy in ``_release`` is freed once nothing reads it (``host_io == 0``):
while its node keeps a device copy at once (a lock pins the device copy, which is what the
request reads), a host-only node once it is an unlocked leaf (a locked one is about to be
loaded, and goes after its load).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvtier.controller.host_leases import HostLeases
from kvtier.controller.records import Span
from kvtier.errors import IntegrityError
from kvtier.pools.host import HostPool
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import Evicted


class Staging:
    """Backup queue, release set and admission of one cache in ``buffer_only`` mode.

    ``alloc_host(pages)`` allocates host pages for a copy of device ``pages`` (evicting
    reclaimable copies); ``evict_host(n)`` drops at least ``n`` pages of reclaimable host
    copies if it can and returns how many it dropped.
    """

    def __init__(
        self,
        tree: RadixTree,
        host: HostPool,
        alloc_host: Callable[[torch.Tensor], torch.Tensor | None],
        evict_host: Callable[[int], int],
    ) -> None:
        self.tree = tree
        self.host = host
        self._alloc_host = alloc_host
        self._evict_host = evict_host
        self.waiting: list[Span] = []
        """Nodes waiting for host room to be backed up, in order; each pins ``device_io``."""
        self._release: dict[int, Node] = {}
        """Host copies to free once idle, by node id (insertion order)."""
        self.dropped_pages = 0
        """Host copies dropped because storage refused their write."""
        self.released_pages = 0
        """Host copies freed after their write (stored or dropped) or load completed."""
        self.cut_read_pages = 0
        """Pages fetches wanted beyond what the host pool could stage."""
        self.windows: Callable[[torch.Tensor], torch.Tensor] | None = None
        """A relocatable host arena: which device pages have window rows (what a backup of
        them takes); ``None`` for a fixed host pool (set by the controller)."""
        self.leases = HostLeases(None)
        """The storage I/O's leases on a relocatable host pool: a copy a late write still
        reads is freed once it let go (set by the controller)."""
        tree.split_hooks.append(self.on_split)

    # ---- writes ---------------------------------------------------------------------------
    def enqueue(self, nodes: list[Node]) -> None:
        """Queue the device copies of ``nodes`` that storage lacks for a backup (those already
        stored, with a host copy, or in a copy are skipped)."""
        for node in nodes:
            if node.device is None or node.on_host or node.device_io or node.in_storage:
                continue
            if node.parent is None:
                continue
            self.tree.begin_io(node, "device")
            self.waiting.append(Span(node))

    def chunks(self) -> list[Span]:
        """Take host pages for queued nodes as far as the pool allows, in queue order: an
        unlocked node longer than the free pages is split and its first pages go now. A locked
        node is never split (its request holds its path, e.g. between ``lock`` and ``load``): it
        waits for room for all of it while the nodes behind it go. Returns the spans to copy
        (node, host pages); the queue's pins on them are handed to the caller's copy."""
        out: list[Span] = []
        i = 0
        while i < len(self.waiting):
            node = self.waiting[i].node
            if node.on_host or node.in_storage or node.parent is None:
                self.waiting.pop(i)
                self.tree.end_io(node, "device")
                continue
            dev = node.device
            if dev is None:
                raise IntegrityError(f"queued backup of {node!r} lost its device copy")
            pages = self._alloc_host(dev)
            if pages is None:
                fit = self._fit(dev)  # eviction already ran
                if fit == 0:
                    break
                if node.lock_ref:
                    i += 1
                    continue
                node = self.tree.split(node, fit)  # ``on_split`` queues the head first
                pages = self._alloc_host(node.device)  # type: ignore[arg-type]
                if pages is None:
                    raise IntegrityError(f"{fit} host pages free but not allocatable")
            if self.waiting.pop(i).node is not node:
                raise IntegrityError(f"backup queue out of order at {node!r}")
            out.append(Span(node, pages))
        return out

    def written(self, node: Node, stored: bool) -> None:
        """The storage write of ``node``'s host copy was reaped (``stored``: every page
        landed): the copy goes, stored or not."""
        if not stored and node.host is not None:
            self.dropped_pages += node.host.numel()
        self.mark(node)

    def waiting_pages(self) -> int:
        return sum(sp.node.num_pages(self.tree.page_size) for sp in self.waiting)

    # ---- room in bytes --------------------------------------------------------------------
    def _fit(self, device: torch.Tensor) -> int:
        """Leading pages of a backup of ``device`` pages the host has room for now."""
        if self.windows is None:
            return self.host.allocator.available
        return self.host.fit_prefix(self.windows(device))  # type: ignore[attr-defined]

    def copy_bytes(self, device: torch.Tensor) -> int:
        """Host bytes a backup of ``device`` pages takes."""
        if self.windows is None:
            return device.numel() * self.host.page_bytes
        have = int(self.windows(device).sum())
        window = self._window_bytes()
        return device.numel() * (self.host.page_bytes - window) + have * window

    def _window_bytes(self) -> int:
        return sum(s.page_bytes(self.host.page_size) for s in self.host.specs if s.kind == "window")

    def free_bytes(self) -> int:
        """Host bytes free now (an arena's free units, whatever their fragmentation:
        allocations compact)."""
        if self.windows is None:
            return self.host.allocator.available * self.host.page_bytes
        return self.host.bytes_total - self.host.bytes_used  # type: ignore[attr-defined]

    def waiting_bytes(self) -> int:
        return sum(
            self.copy_bytes(sp.node.device) for sp in self.waiting if sp.node.device is not None
        )

    # ---- reads ----------------------------------------------------------------------------
    def reserve(self) -> int:
        """Free host bytes a fetch must leave to the queued backups (module docstring)."""
        return min(self.waiting_bytes(), self.host.nbytes // 2)

    def admit(self, n: int) -> int:
        """How many of ``n`` pages a fetch may take now: free or reclaimable room (reclaimed
        here) beyond the write reserve, a whole page each."""
        reserve, page = self.reserve(), self.host.page_bytes
        short = n * page + reserve - self.free_bytes()
        while short > 0 and self._evict_host(-(-short // page)):
            short = n * page + reserve - self.free_bytes()
        fit = max(0, min(n, self.host.allocator.available, (self.free_bytes() - reserve) // page))
        self.cut_read_pages += n - fit
        return fit

    def loaded(self, nodes: list[Node]) -> None:
        """Loads of ``nodes``' host copies to device completed: the copies go."""
        for node in nodes:
            self.mark(node)
        self.release_idle()

    # ---- release --------------------------------------------------------------------------
    def mark(self, node: Node) -> None:
        """Free ``node``'s host copy once nothing uses it (module docstring)."""
        self._release[node.id] = node

    def release_idle(self) -> None:
        """Free every marked host copy that nothing uses now; the others stay marked."""
        progress = True
        while progress and self._release:
            progress = False
            for key, node in list(self._release.items()):
                done = self._try_release(node)
                if done:
                    del self._release[key]
                    progress = True

    def _try_release(self, node: Node) -> bool:
        """Whether ``node`` needs no release any more (freed now, or nothing to free)."""
        if node.parent is None or node.host is None:
            return True
        if node.host_io:
            return False
        if node.on_device:
            pages = self.tree.drop_host(node)
        elif not node.children and not node.lock_ref:
            out = Evicted()
            self.tree.eviction.drop_leaf(node, out)
            pages = torch.cat(out.host_pages)
        else:
            return False
        self.leases.free(pages, self.host.allocator.free)
        self.released_pages += pages.numel()
        return True

    # ---- bookkeeping ----------------------------------------------------------------------
    def on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        """``prefix`` took ``suffix``'s first pages: it shares its queue pin (ahead of it) and
        its pending release."""
        for i, sp in enumerate(self.waiting):
            if sp.node is suffix:
                self.waiting.insert(i, Span(prefix))
                break
        if suffix.id in self._release:
            self._release[prefix.id] = prefix

    def pinned(self) -> list[tuple[Node, str]]:
        """``(node, "device")`` for every queued backup's pin."""
        return [(sp.node, "device") for sp in self.waiting]

    def stats(self, write_pages: int, read_pages: int) -> dict[str, int]:
        """Staging gauges and counters for ``cache.stats()`` given the host pages staged for
        writes and for reads (counted by the caller, which sees the flights)."""
        return {
            "host_staged_write_pages": write_pages,
            "host_staged_read_pages": read_pages,
            "host_backup_waiting_pages": self.waiting_pages(),
            "host_backup_waiting_bytes": self.waiting_bytes(),
            "host_write_reserve_bytes": self.reserve(),
            "host_staging_released_pages": self.released_pages,
            "host_staging_dropped_pages": self.dropped_pages,
            "host_staging_cut_read_pages": self.cut_read_pages,
        }

    def check_integrity(self) -> None:
        """Every queued node is attached, device-resident and without a host copy."""
        seen: set[int] = set()
        for sp in self.waiting:
            node = sp.node
            if node.id in seen:
                raise IntegrityError(f"{node!r} queued twice for a backup")
            seen.add(node.id)
            if node.parent is None or node.device is None or not node.device_io:
                raise IntegrityError(f"queued backup of {node!r}: detached or unpinned")

"""``Controller``: the one owner of page movement and visibility.

Every transfer is a typed in-flight record; ``poll`` completes the finished ones and only then
makes their copies visible to ``match`` (contract 3):

    device → host   backup     ``Backups``     visible at the poll after the copy completed
    host → device   load       ``Loads``       the compute stream waits before any kernel reads
    host → storage  write      ``Backups``     the key exists only after the backend's write
    storage → host  prefetch   ``Prefetcher``  pages enter the tree in verified chunks, in order

In-flight work pins what it reads (``device_io``/``host_io``, through tree methods), so
eviction never frees memory under a transfer; node splits re-attribute every record's spans
(``records.split_spans``). ``check_integrity`` rebuilds every node's pins from the records.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Callable

import torch

from kvtier.config import CacheConfig
from kvtier.controller.backup import Backups
from kvtier.controller.host_leases import HostLeases
from kvtier.controller.load import Loads
from kvtier.controller.prefetch import Prefetcher
from kvtier.controller.staging import Staging
from kvtier.controller.storage_admission import StorageAdmission
from kvtier.controller.storage_io import StorageIO
from kvtier.controller.window_backup import WindowBackups
from kvtier.controller.write_policy import make_policy
from kvtier.errors import ConfigError, IntegrityError
from kvtier.events.emitter import EventEmitter, EventSink
from kvtier.keys import Namespace
from kvtier.metrics import Metrics
from kvtier.parallel.alloc import check_tree_owners
from kvtier.parallel.group import Group, SoloGroup
from kvtier.parallel.layout import CPLayout
from kvtier.pools.allocator import PageAllocator
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.host_arena import HostArena
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.storage.base import StorageBackend
from kvtier.transfer.delays import CompletionDelays
from kvtier.transfer.layers import Layered
from kvtier.transfer.mover import Mover
from kvtier.transfer.translate import PageTranslator
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import Evicted, TreeMatch


class Controller:
    """Owns the mover, the storage I/O and every in-flight record; the pools' allocators are
    the single owners of free pages, the tree the single writer of node state."""

    def __init__(
        self,
        config: CacheConfig,
        tree: RadixTree,
        device_pool: DevicePool,
        host_pool: HostPool | None,
        storage: StorageBackend | None,
        namespace: Namespace,
        metrics: Metrics,
        translator: PageTranslator | None = None,
        group: Group | None = None,
        admission: StorageAdmission | None = None,
    ) -> None:
        """``translator`` maps logical pages to the pools' physical pages for every copy and
        every storage object (identity when ``None``); ``group`` is the CP group whose ranks
        agree on every completion (``config.cp_size`` ranks); ``admission`` says which host
        copies are written to storage (``None``: all)."""
        self.group: Group = group or SoloGroup()
        self.config = config
        self.lanes = config.cp_size
        self.layout = (
            CPLayout(config.cp_size, config.cp_rank, config.cp_pattern)
            if config.cp_size > 1
            else None
        )
        self.translator = translator
        self.delays = CompletionDelays(
            config.test_completion_polls, f"{config.test_completion_seed}/{config.cp_rank}"
        )
        """Test completion delays of copies and storage I/O (off unless configured)."""
        self.tree = tree
        self.dev = device_pool
        self.host = host_pool
        self.metrics = metrics
        self.host_leases = HostLeases(host_pool)
        """The storage I/O's leases on a relocatable host pool (a no-op for a fixed one)."""
        self.mover: Mover | None = None
        self.backups: Backups | None = None
        if host_pool is not None:
            self.mover = Mover(
                device_pool,
                host_pool,
                translator=translator,
                debug_checks=config.debug_checks,
                backup_share=config.backup_share,
                mechanism=config.transfer_mechanism,
                delays=self.delays,
            )
            self.backups = Backups(
                tree, host_pool, self.mover, self.alloc_host_copy, namespace, metrics, self.group
            )
            self.backups.leases = self.host_leases
            self.backups.admission = admission
        self.loads = Loads(
            tree, device_pool, self.mover, self.alloc_device_like, metrics, self.group
        )
        self.windows: WindowBackups | None = None
        """Window-only backups (a window pool with a host tier)."""
        if isinstance(device_pool, UnifiedPool) and self.backups is not None and self.mover:
            window = next(s.name for s in device_pool.specs if s.kind == "window")
            self.windows = WindowBackups(
                tree, device_pool, self.mover, window, self.backups.rewrite, metrics, self.group
            )
        self.policy = make_policy(config, self.backups)
        self.staging: Staging | None = None
        if config.host_mode == "buffer_only" and host_pool is not None and self.backups is not None:
            self.staging = Staging(tree, host_pool, self.alloc_host_copy, self.evict_host)
            if isinstance(host_pool, HostArena) and isinstance(device_pool, UnifiedPool):
                self.staging.windows = device_pool.has_window
            self.staging.leases = self.host_leases
            self.backups.staging = self.staging
            self.loads.on_loaded = self.backups.loaded
        self.io: StorageIO | None = None
        self.prefetcher: Prefetcher | None = None
        if storage is not None:
            self.attach_storage(storage)
        tree.split_hooks.append(self._on_split)
        self.events: EventEmitter | None = None
        """KV events of every residency change (``CacheConfig.kv_events``), published a batch
        per poll."""
        if config.kv_events is not None:
            self.publish_events(open_publisher(config))

    def publish_events(self, sink: EventSink) -> EventEmitter:
        """Publish the tree's residency changes as KV events to ``sink`` from now on (a batch
        per ``poll``, ``publish_batch``)."""
        if self.events is not None:
            raise ConfigError("KV events are already published (kv_events)")
        self.events = EventEmitter(self.tree.root, self.tree.page_size, sink, self.metrics)
        self.tree.listen(self.events)
        return self.events

    def publish_batch(self) -> None:
        """Publish the KV events since the last batch as one batch (never blocks)."""
        if self.events is not None:
            self.events.publish()

    def attach_storage(self, storage: StorageBackend) -> None:
        """Start the L3 I/O thread over ``storage``."""
        if self.host is None or self.backups is None:
            raise ConfigError("storage requires enable_host=True: L3 moves pages through L2")
        self.io = StorageIO(
            storage,
            self.host,
            self.metrics,
            self.tree.page_size,
            self.translator,
            self.layout,
            self.group,
            self.delays,
        )
        self.backups.io = self.io
        self.prefetcher = Prefetcher(
            self.config,
            self.tree,
            self.host,
            self.io,
            self.alloc_host_at,
            self.metrics,
            self.seq_owners,
            self.group,
            self.staging,
        )
        self.prefetcher.leases = self.host_leases
        self.prefetcher.release_replaced = self.release_replaced

    @property
    def storage(self) -> StorageBackend | None:
        """The L3 backend (the one place it is held)."""
        return self.io.backend if self.io is not None else None

    # ---- allocation with eviction --------------------------------------------------------
    # Under context parallelism (``lanes > 1``) every allocation names each page's owner (the
    # rank that holds its bytes, ``kvtier.pools.allocator``) and eviction counts progress in
    # freed pages of the lanes that are short, not in logical pages: dropping a node whose
    # pages all live on rank 1 frees nothing rank 0 can use.
    def alloc_device(self, n: int, owners: list[int] | None = None) -> torch.Tensor | None:
        """``n`` device pages (page ``i`` on lane ``owners[i]`` when given), evicting unlocked
        cached pages if needed; ``None`` if impossible."""
        alloc = self.dev.allocator
        if owners is None:
            return self._alloc_evicting(alloc, n, self.evict_device, self.dev.alloc_pages)
        self._make_room(alloc, owners, self.evict_device)
        return alloc.alloc_owned(owners)

    def alloc_host(self, n: int, owners: list[int] | None = None) -> torch.Tensor | None:
        """``n`` host pages (on lanes ``owners`` when given), evicting unlocked host copies
        if needed; ``None`` if impossible."""
        if self.host is None:
            return None
        alloc = self.host.allocator
        if owners is None:
            return self._alloc_evicting(alloc, n, self.evict_host, alloc.alloc)
        self._make_room(alloc, owners, self.evict_host)
        return alloc.alloc_owned(owners)

    @staticmethod
    def _alloc_evicting(
        alloc: PageAllocator,
        n: int,
        evict: Callable[[int], int],
        take: Callable[[int], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """``n`` pages of one lane (``take(n)``, from the pool ``alloc`` counts), evicting with
        ``evict`` until they fit or nothing more goes."""
        while True:
            # A window pool's page frees less than a fresh page takes when it had no window
            # rows: evict until the room is there or nothing more goes.
            while (short := n - alloc.available) > 0 and evict(short) > 0:
                pass
            pages = take(n)
            # An arena with leased pages may promise room compaction cannot make around them
            # (``ArenaAllocator.optimistic``): make more and try again.
            if pages is not None or not getattr(alloc, "optimistic", False):
                return pages
            if evict(max(1, n - alloc.fit([0] * n))) == 0:
                return None

    def alloc_device_like(self, pages: torch.Tensor) -> torch.Tensor | None:
        """As many device pages as ``pages`` has, on the same lanes (a load of a host copy)."""
        return self.alloc_device(pages.numel(), self._lanes_of(pages))

    def alloc_host_like(self, pages: torch.Tensor) -> torch.Tensor | None:
        """As many host pages as ``pages`` has, on the same lanes (a backup of a device copy)."""
        return self.alloc_host(pages.numel(), self._lanes_of(pages))

    def alloc_host_copy(self, device: torch.Tensor) -> torch.Tensor | None:
        """Host pages for a copy of ``device`` pages (a backup). A relocatable host arena
        gives window envelopes only to the pages whose device copy has window rows, evicting
        until they fit; ``None`` if they cannot."""
        host = self.host
        if not isinstance(host, HostArena) or not isinstance(self.dev, UnifiedPool):
            return self.alloc_host_like(device)
        windows = self.dev.has_window(device)
        while True:
            pages = host.take(windows.numel(), windows)
            if pages is not None:
                return pages
            short = windows.numel() - host.fit_prefix(windows)
            if self.evict_host(max(1, short)) == 0:
                return None

    def alloc_device_at(self, first_page: int, n: int) -> torch.Tensor | None:
        """Device pages for sequence pages ``[first_page, first_page + n)``, each on the lane
        of the rank that owns it under the CP layout (fresh pages for computed tokens)."""
        return self.alloc_device(n, self.seq_owners(first_page, n))

    def alloc_host_at(self, first_page: int, n: int) -> torch.Tensor | None:
        """Host pages for sequence pages ``[first_page, first_page + n)`` (a storage fetch)."""
        return self.alloc_host(n, self.seq_owners(first_page, n))

    def seq_owners(self, first_page: int, n: int) -> list[int] | None:
        """Owner of each sequence page ``[first_page, first_page + n)`` (``None`` without
        context parallelism)."""
        if self.layout is None:
            return None
        return self.layout.owners(first_page, first_page + n)

    def _lanes_of(self, pages: torch.Tensor) -> list[int] | None:
        if self.lanes == 1:
            return None
        return (pages.reshape(-1).cpu() % self.lanes).tolist()

    def _make_room(
        self,
        alloc: PageAllocator,
        owners: list[int],
        evict: Callable[[int, Callable[[torch.Tensor], int] | None], int],
    ) -> None:
        while short := alloc.shortfall(owners):
            lanes = torch.tensor(list(short), dtype=torch.int64)

            def useful(pages: torch.Tensor, lanes: torch.Tensor = lanes) -> int:
                return int(torch.isin(pages.reshape(-1).cpu() % self.lanes, lanes).sum())

            if evict(sum(short.values()), useful) == 0:
                return

    def evict_device(self, n: int, weight: Callable[[torch.Tensor], int] | None = None) -> int:
        """Drop at least ``n`` device pages' worth of unlocked copies if possible (as counted
        by ``weight``, see ``RadixTree.evict_device``); returns that count."""
        ev = self.tree.evict_device(n, self.policy.before_evict, weight)
        self._release(ev)
        return sum(weight(p) for p in ev.device_pages) if weight else ev.num_device()

    def evict_host(self, n: int, weight: Callable[[torch.Tensor], int] | None = None) -> int:
        """Drop at least ``n`` host pages' worth of unlocked copies if possible."""
        ev = self.tree.evict_host(n, weight)
        self._release(ev)
        return sum(weight(p) for p in ev.host_pages) if weight else ev.num_host()

    def _release(self, ev: Evicted, evicted: bool = True) -> None:
        """Give the pages the tree dropped back to their allocators (the one place that
        does). ``evicted``: eviction dropped them, so they count as evicted pages."""
        for p in ev.device_pages:
            self.released(p)
            self.dev.free_pages(p)
        if ev.device_pages and evicted:
            self.metrics.inc("evicted_device_pages", ev.num_device())
        if self.host is not None:
            for p in ev.host_pages:
                self.host_leases.free(p, self.host.allocator.free)
            if ev.host_pages and evicted:
                self.metrics.inc("evicted_host_pages", ev.num_host())

    def release_replaced(self, ev: Evicted) -> None:
        """Free the pages of partial tails a longer version replaced in the tree."""
        self._release(ev, evicted=False)

    # ---- per-layer backups ----------------------------------------------------------------
    def reserve_layers(self, device: torch.Tensor) -> Layered | None:
        """Host pages and a per-layer copy for the engine's ``device`` pages during the coming
        forward (``Backups.reserve``); ``None`` without a host tier or room in it."""
        if self.backups is None:
            return None
        return self.backups.reserve(device)

    def finish_layers(self, layered: Layered, ok: bool = True) -> None:
        if self.backups is None:
            raise IntegrityError("finish_layers without a host tier")
        self.backups.finish_layers(layered, ok)

    def released(self, device: torch.Tensor) -> None:
        """``device`` pages leave their owner (freed or evicted): a host copy reserved for them
        is given up (freed once its copy is done)."""
        if self.backups is not None:
            self.backups.reserved.release(device)

    # ---- the lock protocol and the hooks of the write policy -----------------------------
    def lock(self, match: TreeMatch) -> Node:
        """Pin ``match`` for a request; the policy and the storage tier see the hit."""
        node = self.tree.lock(match)
        path = match.path
        self.policy.on_hit(path)
        if self.backups is not None:
            # A host copy whose storage backup was dropped (store full or down) gets another
            # try when it is used again; stored objects get their recency refreshed.
            self.backups.to_storage([n for n in path if n.on_host and not n.in_storage])
            self.backups.touch(path)
        return node

    def unlock(self, node: Node) -> None:
        self.tree.unlock(node)

    def on_insert(self, nodes: list[Node]) -> None:
        """``nodes`` just took device pages from the engine."""
        self.policy.on_insert(nodes)

    def on_windows(self, nodes: list[Node]) -> None:
        """``nodes``' device pages just took window rows from the engine's duplicates of them:
        host copies made without those rows get them (``WindowBackups``)."""
        if self.windows is not None:
            self.windows.start(nodes)

    def counted(self, nodes: list[Node]) -> None:
        """An admission was counted on ``nodes`` (moved up for it): later hits on them are
        hits of the tier they are in."""
        for node in nodes:
            self.tree.set_origin(node, None)

    def load(self, path: list[Node], overlap: bool = False) -> tuple[int, list | None]:
        """Host → device for the locked ``path`` (``Loads.load``)."""
        return self.loads.load(path, overlap)

    # ---- progress -----------------------------------------------------------------------
    def poll(self) -> None:
        """Queue paced backup chunks, complete finished transfers and make their copies
        visible. Never blocks."""
        if self.mover is not None:
            self.mover.pump()
        if self.host is not None:
            self.host_leases.poll(self.host.allocator.free)
        if self.backups is not None:
            self.backups.poll()
        if self.windows is not None:
            self.windows.poll()
        self.loads.poll()
        if self.prefetcher is not None:
            self.prefetcher.poll()
        self.publish_batch()

    def drain(self, on_progress: Callable[[], None] | None = None) -> None:
        """Block until every in-flight transfer and storage write completed and is visible."""
        if self.backups is not None:
            self.backups.wait()
        if self.windows is not None:
            self.windows.wait()
        self.loads.wait()
        self.poll()
        if self.io is not None and self.prefetcher is not None:
            self.io.wait_all()
            self.prefetcher.wait_all()
        self.poll()
        if on_progress is not None:
            on_progress()

    def in_flight(self) -> bool:
        """Whether a copy, a storage write or a fetch is still in flight."""
        busy = bool(self.loads.flights) or bool(self.backups and self.backups.flights)
        busy = busy or bool(self.windows and self.windows.flights)
        return (
            busy
            or bool(self.backups and (self.backups.pinned() or self.backups.reserved.busy()))
            or bool(self.prefetcher and self.prefetcher.ops)
            or self.host_leases.busy()
        )

    def _on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        if self.backups is not None:
            self.backups.on_split(prefix, suffix, n)
        if self.windows is not None:
            self.windows.on_split(prefix, suffix, n)
        self.loads.on_split(prefix, suffix, n)
        if self.io is not None:
            self.io.on_split(prefix, suffix, n)

    def inflight_host_pages(self) -> int:
        """Host pages owned by in-flight work rather than by the tree."""
        n = self.backups.inflight_host_pages() if self.backups is not None else 0
        n += self.host_leases.deferred_pages
        return n + (self.prefetcher.pending_host_pages() if self.prefetcher is not None else 0)

    def check_integrity(self) -> None:
        """Every node's ``device_io``/``host_io`` equals the pins its in-flight records hold,
        and the prefetch map only names open fetches."""
        pins: Counter[tuple[int, str]] = Counter()
        held = self.loads.pinned() + (self.backups.pinned() if self.backups else [])
        held += self.windows.pinned() if self.windows else []
        for node, tier in held:
            pins[(id(node), tier)] += 1
        for node in self.tree.nodes():
            for tier, count in (("device", node.device_io), ("host", node.host_io)):
                have = pins.get((id(node), tier), 0)
                if have != count:
                    raise IntegrityError(
                        f"node {node.id}: {tier}_io={count} but in-flight records hold "
                        f"{have} (rank {self.config.rank})"
                    )
        if self.backups is not None:
            self.backups.check_integrity()
        if self.prefetcher is not None:
            self.prefetcher.check_integrity()
        if self.layout is not None:
            check_tree_owners(self.tree, self.layout)

    def close(self) -> None:
        self.drain()
        if self.mover is not None:
            self.mover.close()
        if self.prefetcher is not None:
            self.prefetcher.cancel_all()
        if self.io is not None:
            self.io.close()
        if self.events is not None:
            self.tree.listen(None)
            self.events.close()
            self.events = None


def open_publisher(config: CacheConfig) -> EventSink:
    """The ZeroMQ publisher ``config.kv_events`` asks for; pyzmq and msgpack are imported only
    here, so the core needs torch alone. ``ConfigError`` when they are missing or an endpoint
    cannot be used."""
    try:
        from kvtier.events.publisher import ZmqPublisher
    except ImportError as e:
        raise ConfigError(
            f"kv_events needs pyzmq and msgpack (pip install 'kvtier[events]'): {e}"
        ) from None
    endpoint = config.kv_events
    if endpoint is None:
        raise ConfigError("kv_events is not set: no endpoint to publish KV events on")
    return ZmqPublisher(
        endpoint,
        config.kv_events_replay,
        topic=config.kv_events_instance or f"{socket.gethostname()}:{os.getpid()}",
        queue_batches=config.kv_events_queue,
        buffer_batches=config.kv_events_buffer,
    )

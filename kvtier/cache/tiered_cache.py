"""``TieredCache``: the one facade an engine talks to.

Request flow (engine's view)::

    m = cache.match(tokens)          # MatchResult: device_len, host_len, storage_len, handle
    pf = cache.prefetch(m)           # optional: storage → host for m.storage_len tokens
    ... cache.prefetch_ready(pf) ... cache.finish_prefetch(pf); m = cache.match(tokens)
    cache.lock(m.handle)             # right after match; the prefix stays cached while locked
    ld = cache.load(m)               # host → device; ld.locs are the prefix's token slots
    locs = cache.alloc(n)            # fresh whole pages for the uncached suffix
    ... compute ...
    cache.finish(tokens, all_locs, prefix_len=ld.locs.numel(), handle=m.handle)
    cache.poll()                     # once per step, after the step's device → host read (or
                                     # beside its forward: see poll): completes transfers, makes
                                     # copies visible, queues backups

Range table of one finished request's slots (``ps`` = page size, ``n`` = tokens computed,
``full = n - n % ps``)::

    [0, prefix_len)            cache-owned pages from load(); never written or freed by the engine
                               (except a tail copy: see below)
    [prefix_len, cached_len)   the engine's pages that duplicate pages cached meanwhile → freed
    [cached_len, full)         the engine's pages, now owned by the tree
    [full, n)                  the trailing partial page: cached as a partial tail (default),
                               freed with ``cache_partial_pages=False``, a state pool or CP
    [n, len(locs))             padding slots of the last page: never cached, never returned

Partial tails and the *tail copy* a request ending in one is served through:
``kvtier.cache.tail_copy``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.cache.parts import build_parts
from kvtier.cache.ranks import handshake, owned_exists
from kvtier.cache.report import cache_stats, check_cache, check_windows, window_stats
from kvtier.cache.results import Handle, InsertResult, LoadResult, MatchResult
from kvtier.cache.resume import served_prefix, storage_extension, usable_lengths
from kvtier.cache.tail_copy import with_tail_copy
from kvtier.config import CacheConfig
from kvtier.controller import PrefetchOp
from kvtier.errors import ConfigError, IntegrityError, RequestError
from kvtier.keys import Namespace, PageKey
from kvtier.metrics import prometheus_registry
from kvtier.paging import align_down
from kvtier.parallel.acks import all_ranks
from kvtier.parallel.group import Group
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.storage.base import StorageBackend
from kvtier.storage.registry import check_capabilities
from kvtier.transfer.layers import Layered
from kvtier.transfer.translate import PageTranslator
from kvtier.tree.results import truncate_match


class TieredCache:
    """Device pool + host pool + storage under one radix tree."""

    def __init__(
        self,
        config: CacheConfig,
        specs: Sequence[PoolSpec],
        translator: PageTranslator | None = None,
        group: Group | None = None,
    ) -> None:
        """``group`` is the context-parallel group this rank belongs to (``CacheConfig.cp_size``
        ranks; ``None`` without context parallelism)."""
        parts = self.parts = build_parts(config, specs, translator, group)
        # The parts the engine and the tests reach through the facade (one owner each: the
        # facade holds references, ``CacheParts`` built them).
        self.config = config
        self.specs = parts.specs
        self.group: Group = parts.group
        self.kv_page_size = config.page_size
        self.page_size = parts.page_size
        self.resume = parts.resume
        self.stateful = parts.resume.state
        self.device = parts.device
        self.device_pool: DevicePool | UnifiedPool = parts.device_pool
        self.host_pool: HostPool | None = parts.host_pool
        self._on_device = parts.on_device
        self.namespace: Namespace = parts.namespace
        self.metrics = parts.metrics
        self.tree = parts.tree
        self.kv_buffers = parts.kv_buffers
        """What the engine reads and writes: device buffers by physical slot (``DeviceKV``)."""
        self.controller = parts.controller
        self.engine_pages = parts.engine_pages
        self._closed = False
        if self.group.size > 1:
            self._handshake()

    def _handshake(self) -> None:
        host = self.host_pool.num_pages if self.host_pool is not None else 0
        try:
            handshake(self.group, self.config, self.namespace, self.page_size, host)
        except ConfigError:
            self.close()
            raise

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RequestError(f"TieredCache.{what}() after close()")

    def attach_storage(self, backend: StorageBackend) -> None:
        """Attach an L3 backend at runtime (capability-gated like one configured at start)."""
        if self.host_pool is None:
            raise ConfigError("attaching storage requires enable_host=True")
        if self.storage is not None:
            raise ConfigError(f"storage backend {self.storage.name!r} is already attached")
        check_capabilities(backend, self.config, self.page_size)
        self.controller.attach_storage(backend)

    @property
    def storage(self) -> StorageBackend | None:
        """The attached L3 backend, if any."""
        return self.controller.storage

    @property
    def tree_page_tokens(self) -> int:
        """Tokens per tree page: the unit of allocation, of the tree and of one storage object
        (lcm of every component's granularity; ``page_size`` is the same number, while
        ``CacheConfig.page_size`` is the KV page). Pool sizes count tree pages."""
        return self.page_size

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], probe_storage: bool = True) -> MatchResult:
        """Longest resumable cached prefix of ``tokens`` per tier. Never mutates the index.

        ``storage_len`` counts the tokens after ``cached_len`` that become resumable once a
        prefetch brought storage's pages in. ``probe_storage=False`` skips the storage lookup
        (hashing and ``batch_exists``), e.g. when a prefetch for these tokens already ran.
        """
        self._check_open("match")
        ps = self.page_size
        tm = self.tree.match(tokens)
        end = max(align_down(len(tokens), ps), tm.matched_len)
        device_len, usable = usable_lengths(tm, self.resume, ps, self._on_device)
        keys: list[PageKey] = []
        tail = 0
        io = self.controller.io
        if probe_storage and io is not None:
            tails = self.engine_pages.tails
            keys, tail = storage_extension(
                io.backend,
                self.tree,
                self.namespace,
                tm,
                tokens if tails else tokens[:end],
                ps,
                self.resume,
                self._exists,
                tails,
                self._on_device,
                # What storage holds is what every rank found of the pages it owns.
                self.group.all_reduce_min if self.group.size > 1 else None,
            )
            if len(keys) < self.config.prefetch_min_pages:
                keys, tail = [], 0
        fetched = len(keys) * ps - (ps - tail) % ps if keys else 0
        if tail:  # the fetch's last page is a partial tail: the handle's tokens end with it
            end = tm.matched_len + fetched
        storage_len = tm.matched_len + fetched - usable if keys else 0
        handle = Handle(tm, usable, tuple(tokens[:end]), keys)
        return MatchResult(device_len, usable - device_len, storage_len, handle)

    def _exists(self, keys: list[PageKey], first_page: int) -> int:
        """Leading ``keys`` (sequence pages from ``first_page``) in storage as far as this
        rank can tell (``ranks.owned_exists``)."""
        backend = self.controller.storage
        if backend is None:
            return 0
        owners = self.controller.seq_owners(first_page, len(keys))
        return owned_exists(backend, keys, owners, self.config.cp_rank)

    # ---- lock protocol ------------------------------------------------------------------
    def lock(self, handle: Handle) -> None:
        """Pin the matched prefix. Call right after ``match``, before other cache calls."""
        self._check_open("lock")
        if handle.node is not None:
            raise IntegrityError("handle is already locked")
        handle.locked = truncate_match(handle.match, handle.usable, self.page_size)
        handle.node = self.controller.lock(handle.locked)

    def unlock(self, handle: Handle) -> None:
        """Release the lock (and a tail copy of the last ``load`` that no ``alloc``
        continued: the request was not admitted)."""
        self._release_handle(handle, free_copy=True)

    def _release_handle(self, handle: Handle, free_copy: bool) -> None:
        if handle.node is None:
            raise IntegrityError("unlock of a handle that is not locked")
        self.controller.unlock(handle.node)
        handle.node = None
        handle.load_result = None
        if handle.tail_copy is not None:
            self.engine_pages.forget_copy(handle.tail_copy, free_copy)
            handle.tail_copy = None

    # ---- host → device ------------------------------------------------------------------
    def load(self, m: MatchResult, overlap: bool = False) -> LoadResult:
        """Device slots of the locked prefix, loading its host part into the device tier.

        If the device pool cannot take all of it, a shorter prefix is returned (for a model
        with a state pool, one ending at a checkpoint). A prefix ending in a cached partial
        tail ends with a tail copy's slots, and the lock no longer pins that tail (module
        docstring). With ``overlap`` (CUDA) the compute
        stream is not made to wait for the load: the caller waits on
        ``layer_events[i]`` before reading anchor layer ``i`` (see ``LoadResult``).
        """
        self._check_open("load")
        h = m.handle
        if h.node is None or h.locked is None:
            raise IntegrityError("load of an unlocked match: call lock(m.handle) first")
        path = h.locked.path
        was = {id(n): n.on_device for n in path}
        overlap = overlap and not self.resume.window  # window rows arrive with the last layer
        n, layer_events = self.controller.load(path, overlap)  # may split a node of ``path``
        ps = self.page_size
        h.locked.last_pages = path[-1].num_pages(ps) if path else 0
        before = [was.get(id(node), False) for node in path]
        usable = sum(node.num_tokens for node in path[:n])
        if n < len(path) and self.resume.partial:
            cut = truncate_match(h.locked, usable, ps)
            usable = self.resume.cut(cut, usable, ps, self._on_device)
        served = served_prefix(path, before, usable, ps)
        locs = served.locs
        if h.tail_copy is not None:  # a second load of this handle: its first copy goes
            self.engine_pages.forget_copy(h.tail_copy, free=True)
            h.tail_copy = None
        if usable % ps:
            copied = with_tail_copy(self.engine_pages, locs, layer_events, self.device)
            if copied is None:  # no page for the copy: serve the whole pages before the tail
                served = served_prefix(path, before, align_down(usable, ps), ps)
                locs = served.locs
            else:
                locs, h.tail_copy = copied
            # Either way the request no longer reads the cached tail: unpinned, it can be
            # evicted for the request's own pages (a pool sized for the request still fits).
            h.node = self.tree.unpin_tail(h.node)
        ld = LoadResult(locs, *served.tokens, layer_events=layer_events, state_source=served.last)
        h.load_result, h.moved_nodes = ld, served.moved
        return ld

    def record_hits(self, handle: Handle) -> None:
        """Count the cached prefix of an admitted request (its handle's last ``load``) per
        tier: once per request, as a server reports it in ``usage``; a load whose admission
        was abandoned is not counted. Pages moved up for it count as device hits after."""
        ld = handle.load_result
        if ld is None:
            raise RequestError("record_hits of a handle that was not loaded")
        self.controller.counted(handle.moved_nodes)
        handle.moved_nodes = []
        self.metrics.count_hits(ld, self.specs, self.page_size)

    # ---- storage → host -----------------------------------------------------------------
    def prefetch(self, m: MatchResult) -> PrefetchOp | None:
        """Start fetching ``m.storage_len`` tokens from storage into the host tier."""
        self._check_open("prefetch")
        pf = self.controller.prefetcher
        if m.storage_len == 0 or pf is None:
            return None
        return pf.start(m.handle.match, m.handle.tokens, m.handle.storage_keys)

    def prefetch_ready(self, op: PrefetchOp | None) -> bool:
        """Whether a request waiting on ``op`` may proceed under the prefetch policy (on every
        rank of a CP group: I/O ends and deadlines pass at different times on each)."""
        return op is None or self.agree(op.ready(self.config.prefetch_policy))

    def wait_prefetch(self, ops: Sequence[PrefetchOp], timeout: float) -> None:
        """Block until one of ``ops`` (or a fetch it waits on) finished its I/O, a ``timeout``
        deadline passed, or ``timeout`` seconds elapsed: what an idle engine does instead of
        spinning."""
        if self.controller.prefetcher is not None and ops:
            self.controller.prefetcher.wait(ops, timeout)

    def finish_prefetch(self, op: PrefetchOp | None) -> int:
        """Make what ``op`` (and the fetches it waits on) fetched so far visible; returns the
        tokens ``op`` itself made visible. Match again afterwards.

        Pages still in flight keep arriving and become visible at later polls.
        """
        if op is None or self.controller.prefetcher is None:
            return 0
        return self.controller.prefetcher.release(op)

    # ---- engine-owned pages -------------------------------------------------------------
    def alloc(self, num_tokens: int, at: int | None = None) -> torch.Tensor:
        """Slots of ``ceil(num_tokens / page_size)`` fresh whole pages, evicting if needed;
        ``CapacityError`` when even eviction leaves too few. ``at`` is the sequence position
        of the first of the tokens (a page boundary); under context parallelism it says
        which rank owns each page and is required. After a ``load`` that ended in a tail copy,
        ``at=len(ld.locs)`` (or no ``at``) continues the copy: its remaining slots first."""
        self._check_open("alloc")
        return self.engine_pages.alloc(num_tokens, at)

    @property
    def window(self) -> int:
        """Positions a window pool's queries read (``0``: no window pool)."""
        return self.resume.window

    def release_window(self, locs: torch.Tensor) -> int:
        """The engine's queries no longer read the window rows of the pages of ``locs``
        (window pools): the engine's own pages give theirs back to the arena now, cached pages
        keep them. Returns the pages released; ``0`` without a window pool."""
        self._check_open("release_window")
        return self.engine_pages.release_window(locs)

    def compact(self) -> int:
        """Relocate the device arena's pages to close its holes (window pools; pages a transfer
        holds stay put). Returns the envelopes moved; ``0`` without a window pool."""
        self._check_open("compact")
        if not isinstance(self.device_pool, UnifiedPool):
            return 0
        return self.device_pool.compact()

    def backup_layers(
        self, runs: Sequence[tuple[Sequence[int], torch.Tensor, int, int]]
    ) -> Layered | None:
        """Before a forward, with ``backup_timing='per_layer'``: reserve host copies of the
        pages the forward completes and make them layer by layer. ``runs`` holds, per
        sequence, ``(tokens, locs, start, end)``: the forward computes ``tokens[start:end]``
        into ``locs[start:end]``. Pages that are full after it, the engine's, and whose tokens
        have no host copy yet are copied. Returns the copy (call ``layer_done(j)`` after each
        anchor layer ``j``, then :meth:`end_backup_layers`), or ``None`` (nothing to copy,
        per-layer backups off, or no host room: those pages are backed up at insert)."""
        self._check_open("backup_layers")
        if self.config.backup_timing != "per_layer":
            return None
        pages = self.engine_pages.layer_backup_pages(runs)
        if pages is None:
            return None
        return self.controller.reserve_layers(pages)

    def end_backup_layers(self, layered: Layered, ok: bool = True) -> None:
        """After the forward of :meth:`backup_layers`: the copy completes on its own and the
        pages' host copies become visible once they are inserted and it landed. ``ok=False``
        (the forward failed): the reservation is given up; the pages back up at insert."""
        self.controller.finish_layers(layered, ok)

    def free(self, locs: torch.Tensor) -> None:
        """Free the whole pages containing ``locs``; they must be the engine's (from ``alloc``,
        not given to the tree), else ``RequestError`` and nothing is freed."""
        self._check_open("free")
        if locs.numel():
            self.engine_pages.free(locs)

    def insert(
        self, tokens: Sequence[int], locs: torch.Tensor, checkpoints: torch.Tensor | None = None
    ) -> InsertResult:
        """Index the whole pages of ``tokens`` at ``locs``. The caller frees its duplicates
        ``locs[prefix_len:cached_len]`` (see the range table above).

        ``checkpoints`` (models with a state pool; bool per whole page, or longer) flags the
        pages whose state row holds the state after the page's last token. Omitted: none do.
        Slots outside the pool, misaligned pages, or pages that are neither the engine's nor
        the cached page at their position raise ``RequestError`` before anything changes.
        """
        self._check_open("insert")
        return InsertResult(self.engine_pages.insert(tokens, locs, checkpoints))

    def finish(
        self,
        tokens: Sequence[int],
        locs: torch.Tensor,
        prefix_len: int,
        handle: Handle | None,
        checkpoints: torch.Tensor | None = None,
    ) -> int:
        """End of a request: insert (the partial tail page too, see the range table), free
        duplicates, unlock.

        ``tokens[i]``'s KV is at ``locs[i]`` (``locs`` may run on to the end of the last
        allocated page); ``checkpoints`` as for ``insert``. Returns the tokens now cached.
        ``prefix_len`` must be the length ``load`` returned for ``handle`` (0 without one) and
        ``locs`` must start with those slots; every other page must be the engine's. A
        violation (a second ``finish``, a wrong ``prefix_len``, foreign slots) raises
        ``RequestError`` before anything changes.
        """
        self._check_open("finish")
        unlock = None
        if handle is not None:
            # A tail copy in ``locs`` is the request's page now: ``finish`` caches or frees it.
            def unlock() -> None:
                self._release_handle(handle, free_copy=False)

        return self.engine_pages.finish(tokens, locs, prefix_len, handle, checkpoints, unlock)

    def agree(self, flag: bool) -> bool:
        """True only when ``flag`` is true on every rank of the CP group (``flag`` itself
        without context parallelism): what a scheduler decision that depends on a clock or
        another per-process fact goes through, so every rank decides the same (contract 4)."""
        return bool(flag) if self.group.size == 1 else all_ranks(self.group, flag)

    def record_prefill(self, recomputed_tokens: int) -> None:
        """Count prompt tokens the engine had to compute."""
        self.metrics.inc("recomputed_tokens", recomputed_tokens)

    # ---- progress and introspection -----------------------------------------------------
    def poll(self) -> None:
        """Complete finished transfers, make copies visible, queue paced backups. Never blocks.
        Call once per step, right after its device → host read (``CacheConfig.backup_share``):
        copy engines serve copies in order, so a read queued behind the backups a poll queues
        would wait for them. An engine whose read no copy engine carries (the reference engine's
        kernel writes its logits into mapped pinned memory) may poll once the forward and the
        read are queued, before waiting for them, so the poll's CPU time overlaps the GPU's."""
        self._check_open("poll")
        self.controller.poll()
        if self.config.debug_checks:
            self.check_integrity()

    def in_flight(self) -> bool:
        """Whether any transfer or storage I/O is still in flight (``drain`` would wait)."""
        return self.controller.in_flight()

    def drain(self) -> None:
        """Wait until every transfer and storage write in flight completed and is visible."""
        self.controller.drain()

    def flush(self, host: bool = True) -> None:
        """Drop every unlocked cached page from the device tier (and the host tier when
        ``host``); storage keeps its objects. In-flight work completes first."""
        self.drain()
        self.controller.evict_device(self.device_pool.logical_pages)
        if host and self.host_pool is not None:
            self.controller.evict_host(self.host_pool.logical_pages)

    def stats(self) -> dict:
        """Counters and pool usage (``report.cache_stats``, ``windows.window_stats``)."""
        return {**cache_stats(self.parts), **window_stats(self.parts)}

    def prometheus_registry(self):  # noqa: ANN201 - prometheus_client type, imported lazily
        """A prometheus_client registry exporting ``stats()``."""
        return prometheus_registry(self.stats)

    def check_integrity(self) -> None:
        """Every structure's invariants plus cross-structure page accounting."""
        check_cache(self.parts)
        if self.resume.window:
            check_windows(self.parts)

    def close(self) -> None:
        """Finish in-flight work (storage writes land) and release the backend."""
        if not self._closed:
            self._closed = True
            self.controller.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

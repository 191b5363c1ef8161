"""``TieredCache``: the one facade an engine talks to.

Request flow (engine's view). One call admits a request: match, a storage prefetch under the
configured prefetch policy (it cannot be forgotten: a storage hit never fetched is a silent
miss), lock and load::

    adm = cache.admit(tokens)        # Admission: ready, or pending while a prefetch it waits
    while not cache.admit_ready(adm, timeout=0.05):   # for runs (an engine serves others
        ...                                            # meanwhile instead of waiting)
    new = cache.alloc(adm.num_new, at=adm.cached_len)  # CapacityError: cache.abandon(adm)
    cache.record_hits(adm.handle)
    cache.write_kv(new, rows)        # or per layer: kv_buffers.layer(i)[kv_buffers.slots(new)]
    cache.finish(tokens, torch.cat([adm.locs, new]), prefix_len=adm.cached_len,
                 handle=adm.handle)

The same, call by call (what ``admit`` runs; an engine that schedules fetches itself)::

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
                               freed with ``cache_partial_pages=False``, a state pool or
                               window rows
    [n, len(locs))             padding slots of the last page: never cached, never returned

Partial tails and the *tail copy* a request ending in one is served through:
``kvtier.cache.tail_copy``.

The device buffers the engine writes K/V into: :meth:`TieredCache.write_kv` /
:meth:`TieredCache.read_kv` take the logical slots ``alloc``/``load`` hand out (every layer at
once, translated to physical slots inside); a kernel addresses them per layer through
``cache.kv_buffers`` (``DeviceKV``: ``layer(i, name)`` indexed by ``slots(locs, name)``).

Every entry point refuses an argument of the wrong type or value with a ``RequestError``
(``ConfigError`` for the constructor's) naming the call, the argument and the value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.cache.parts import build_parts
from kvtier.cache.ranks import handshake, owned_exists
from kvtier.cache.report import cache_stats, check_cache, check_windows, window_stats
from kvtier.cache.results import Admission, Handle, InsertResult, LoadResult, MatchResult
from kvtier.cache.resume import run_tokens, served_prefix, storage_extension, usable_lengths
from kvtier.cache.tail_copy import with_tail_copy
from kvtier.config import CacheConfig
from kvtier.controller import PrefetchOp
from kvtier.controller.restore_cost import RestoreCost
from kvtier.errors import (
    ConfigError,
    IntegrityError,
    RequestError,
    check_bool,
    check_int,
    check_number,
    check_type,
    describe,
)
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
from kvtier.transfer.translate import DeviceKV, PageTranslator
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
        ranks; ``None`` without context parallelism). Raises ``ConfigError`` naming a wrong
        argument or option."""
        _check_init(config, specs)
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
        self.kv_buffers: DeviceKV = parts.kv_buffers
        """What the engine's kernels read and write: the device buffers per layer, indexed by
        physical slots (``kv_buffers.slots(locs)`` translates the logical ones). Outside a
        kernel, :meth:`write_kv` and :meth:`read_kv` do both steps."""
        self.controller = parts.controller
        self.engine_pages = parts.engine_pages
        self.restore_cost = RestoreCost(
            config, self.controller, self.group, self.page_size, self.metrics, parts.rates
        )
        """Rates measured as pages move and forwards run, and (``restore_policy='cost'``) the
        decision whether restoring a matched prefix beats computing it again."""
        self._closed = False
        if self.group.size > 1:
            self._handshake()

    def _handshake(self) -> None:
        host = self.host_pool.num_pages if self.host_pool is not None else 0
        try:
            handshake(self.group, self.config, self.namespace, self.page_size, host)
            # A cost decision is a collective: every rank must take it or none.
            cost = 1 if self.restore_cost.on else 0
            low, neg = self.group.all_reduce_min_many([cost, -cost])
            if low != -neg:
                raise ConfigError(
                    f"cp_rank={self.config.cp_rank}: restore_policy differs across the ranks "
                    "of the CP group; every rank needs the same restore_policy"
                )
        except ConfigError:
            self.close()
            raise

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RequestError(f"TieredCache.{what}() after close()")

    @staticmethod
    def _check_handle(handle: object, what: str) -> Handle:
        if isinstance(handle, MatchResult):
            raise RequestError(f"{what}: pass the match's handle (m.handle), not the MatchResult")
        if isinstance(handle, Admission):
            raise RequestError(f"{what}: pass the admission's handle (adm.handle)")
        return check_type(handle, Handle, "handle", what, "the Handle of a match (m.handle)")

    @staticmethod
    def _check_match(m: object, what: str) -> MatchResult:
        if isinstance(m, Handle):
            raise RequestError(f"{what}: pass the MatchResult (m), not its handle")
        return check_type(m, MatchResult, "m", what, "the MatchResult of match()")

    @staticmethod
    def _check_prefetch(op: object, what: str) -> PrefetchOp | None:
        return check_type(op, (PrefetchOp, type(None)), "op", what, "prefetch()'s result")

    def attach_storage(self, backend: StorageBackend) -> None:
        """Attach an L3 backend at runtime (capability-gated like one configured at start)."""
        check_type(backend, StorageBackend, "backend", "attach_storage", error=ConfigError)
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

        Under ``restore_policy='cost'`` the result is what is worth restoring
        (``kvtier.controller.restore_cost``): ``host_len`` is 0 when loading the host part
        would take longer than computing it again (and then ``storage_len`` too), and
        ``storage_len`` covers only the front pages worth fetching; the handle locks and loads
        no more than that.
        """
        self._check_open("match")
        _check_tokens(tokens, "match")
        check_bool(probe_storage, "probe_storage", "match")
        ps = self.page_size
        try:
            tm = self.tree.match(tokens)
        except RequestError as e:
            raise _token_error(tokens, "match", e) from None
        end = max(align_down(len(tokens), ps), tm.matched_len)
        keys: list[PageKey] = []
        tail = 0
        io = self.controller.io
        if probe_storage and io is not None:
            # Nothing hangs below a cached partial tail, but storage may hold the whole page
            # it is the front of and more (written by a request that ran on, or by another
            # instance): look from the whole pages before the tail, and take that run where
            # it reaches past the tail (the fetch replaces the tail in the tree when it lands).
            whole = truncate_match(tm, tm.matched_len - tm.tail, ps) if tm.tail else tm
            tails = self.engine_pages.tails
            keys, tail = storage_extension(
                io.backend,
                self.tree,
                self.namespace,
                whole,
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
            if whole is not tm:
                if run_tokens(keys, tail, ps) > tm.tail:
                    tm = whole
                else:
                    keys, tail = [], 0
        device_len, usable = usable_lengths(tm, self.resume, ps, self._on_device)
        if self.restore_cost.on:
            usable, keys, tail = self._restore_cut(device_len, usable, tm.matched_len, keys, tail)
        fetched = run_tokens(keys, tail, ps)
        if tail:  # the fetch's last page is a partial tail: the handle's tokens end with it
            end = tm.matched_len + fetched
        storage_len = tm.matched_len + fetched - usable if keys else 0
        handle = Handle(tm, usable, tuple(tokens[:end]), keys)
        return MatchResult(device_len, usable - device_len, storage_len, handle)

    def _restore_cut(
        self, device_len: int, usable: int, matched: int, keys: list[PageKey], tail: int
    ) -> tuple[int, list[PageKey], int]:
        """``(usable, keys, tail)`` cut to the front that is cheaper to restore than to compute
        again (``RestoreCost.restore_end``; on every rank of a CP group alike: its arguments
        are the same everywhere)."""
        ps = self.page_size
        stored = matched + run_tokens(keys, tail, ps) - usable if keys else 0
        if usable == device_len and not keys:
            return usable, keys, tail  # nothing to restore
        end = self.restore_cost.restore_end(
            device_len, usable, stored, len(keys), cuttable=not self.resume.partial
        )
        if end < usable:  # the device part, or a probe's page of the host part
            return end, [], 0
        if end >= usable + stored:
            return usable, keys, tail
        keep = (end - usable) // ps
        if keep < self.config.prefetch_min_pages:
            keep = 0
        return usable, keys[:keep], 0

    def _exists(self, keys: list[PageKey], first_page: int) -> int:
        """Leading ``keys`` (sequence pages from ``first_page``) in storage as far as this
        rank can tell (``ranks.owned_exists``)."""
        backend = self.controller.storage
        if backend is None:
            return 0
        owners = self.controller.seq_owners(first_page, len(keys))
        return owned_exists(backend, keys, owners, self.config.cp_rank)

    # ---- admission ----------------------------------------------------------------------
    def admit(self, tokens: Sequence[int], overlap: bool = False) -> Admission:
        """Admit a request's ``tokens`` (those whose KV may come from the cache: an engine that
        needs the last prompt token's logits passes the prompt without it): ``match``, then a
        storage prefetch of what storage holds beyond the cached prefix, then ``lock`` and
        ``load`` (``overlap`` as for ``load``).

        Returns a ready ``Admission`` when nothing is fetched or the prefetch policy lets the
        request go on at once (``best_effort``), else a pending one: poll
        :meth:`admit_ready` until it returns ``True``. A ready admission's prefix is locked
        and loaded: allocate ``adm.num_new`` tokens (``alloc(adm.num_new,
        at=adm.cached_len)``), ``record_hits(adm.handle)`` once the request is in, and end it
        with ``finish(..., prefix_len=adm.cached_len, handle=adm.handle)``; a request that does
        not go in after all (``alloc`` raised ``CapacityError``) is :meth:`abandon`-ed.

        What the host tier could not take of the stored prefix is recomputed: one fetch per
        admission (the reference scheduler retries a short fetch; ``match``/``prefetch`` stay
        available for engines that do).
        """
        self._check_open("admit")
        check_bool(overlap, "overlap", "admit")
        m = self.match(tokens)  # checks ``tokens``
        adm = Admission(tuple(int(t) for t in tokens), overlap)
        if m.storage_len > 0:
            adm.prefetch = self.prefetch(m)
        if adm.prefetch is None:
            self._admit_loaded(adm, m)
        else:
            self.admit_ready(adm)
        return adm

    def admit_ready(self, adm: Admission, timeout: float = 0.0) -> bool:
        """Whether ``adm`` is ready; a pending one whose prefetch the policy lets go on is made
        ready here (what arrived becomes visible, then ``lock`` and ``load``), so ``True`` means
        ``adm``'s fields can be read. ``timeout`` > 0 waits up to that many seconds for the
        fetch's I/O first (what an idle engine does instead of spinning; ``0``: never blocks).
        Under context parallelism every rank calls it at the same point (it agrees across the
        group). An abandoned or finished admission raises ``RequestError``."""
        self._check_open("admit_ready")
        check_type(adm, Admission, "adm", "admit_ready", "the Admission of admit()")
        check_number(timeout, "timeout", "admit_ready")
        if adm.done:
            raise RequestError("admit_ready: the admission was abandoned or finished already")
        if adm.ready:
            return True
        op = adm.prefetch
        if op is None:
            raise IntegrityError("a pending admission without its prefetch")
        if timeout > 0 and not self.prefetch_ready(op):
            self.wait_prefetch([op], timeout)
        if not self.prefetch_ready(op):
            return False
        self.finish_prefetch(op)
        adm.prefetch = None
        # what the fetch brought is in the tree now: no second look at storage
        self._admit_loaded(adm, self.match(adm.tokens, probe_storage=False))
        return True

    def _admit_loaded(self, adm: Admission, m: MatchResult) -> None:
        self.lock(m.handle)
        try:
            ld = self.load(m, overlap=adm.overlap)
        except BaseException:
            self.unlock(m.handle)  # nothing of a failed admission stays pinned
            raise
        adm.match, adm.load_result = m, ld

    def abandon(self, adm: Admission) -> None:
        """The request of ``adm`` does not go in (or no longer waits): a pending admission's
        prefetch is released (pages still in flight land and become visible at later polls), a
        ready one's lock is released and its tail copy freed. ``RequestError`` for an
        admission abandoned or finished already."""
        check_type(adm, Admission, "adm", "abandon", "the Admission of admit()")
        if adm.done:
            raise RequestError("abandon: the admission was abandoned or finished already")
        if adm.prefetch is not None:
            self.finish_prefetch(adm.prefetch)
            adm.prefetch = None
        elif adm.match is not None:
            self.unlock(adm.match.handle)
        adm.abandoned = True

    # ---- lock protocol ------------------------------------------------------------------
    def lock(self, handle: Handle) -> None:
        """Pin the matched prefix. Call right after ``match``, before other cache calls."""
        self._check_open("lock")
        self._check_handle(handle, "lock")
        if handle.node is not None:
            raise IntegrityError("handle is already locked")
        handle.locked = truncate_match(handle.match, handle.usable, self.page_size)
        handle.node = self.controller.lock(handle.locked)

    def unlock(self, handle: Handle) -> None:
        """Release the lock (and a tail copy of the last ``load`` that no ``alloc``
        continued: the request was not admitted)."""
        self._release_handle(self._check_handle(handle, "unlock"), free_copy=True)

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
        self._check_match(m, "load")
        check_bool(overlap, "overlap", "load")
        h = m.handle
        if h.node is None or h.locked is None:
            raise IntegrityError("load of an unlocked match: call lock(m.handle) first")
        path = h.locked.path
        was = {id(n): n.on_device for n in path}
        overlap = overlap and not self.resume.window  # window rows arrive with the last layer
        clock = self.restore_cost.start_load() if m.host_len else None
        n, layer_events = self.controller.load(path, overlap)  # may split a node of ``path``
        if clock is not None:
            self.restore_cost.end_load(clock)
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
        ld = self._check_handle(handle, "record_hits").load_result
        if ld is None:
            raise RequestError("record_hits of a handle that was not loaded")
        self.controller.counted(handle.moved_nodes)
        handle.moved_nodes = []
        self.metrics.count_hits(ld, self.specs, self.page_size)

    # ---- storage → host -----------------------------------------------------------------
    def prefetch(self, m: MatchResult) -> PrefetchOp | None:
        """Start fetching ``m.storage_len`` tokens from storage into the host tier."""
        self._check_open("prefetch")
        self._check_match(m, "prefetch")
        pf = self.controller.prefetcher
        if m.storage_len == 0 or pf is None:
            return None
        return pf.start(m.handle.match, m.handle.tokens, m.handle.storage_keys)

    def prefetch_ready(self, op: PrefetchOp | None) -> bool:
        """Whether a request waiting on ``op`` may proceed under the prefetch policy (on every
        rank of a CP group: I/O ends and deadlines pass at different times on each)."""
        self._check_prefetch(op, "prefetch_ready")
        return op is None or self.agree(op.ready(self.config.prefetch_policy))

    def wait_prefetch(self, ops: Sequence[PrefetchOp], timeout: float) -> None:
        """Block until one of ``ops`` (or a fetch it waits on) finished its I/O, a ``timeout``
        deadline passed, or ``timeout`` seconds elapsed: what an idle engine does instead of
        spinning."""
        check_type(ops, (list, tuple), "ops", "wait_prefetch", "a list of prefetch() results")
        for op in ops:
            check_type(op, PrefetchOp, "ops item", "wait_prefetch", "a prefetch() result")
        check_number(timeout, "timeout", "wait_prefetch")
        if self.controller.prefetcher is not None and ops:
            self.controller.prefetcher.wait(ops, timeout)

    def finish_prefetch(self, op: PrefetchOp | None) -> int:
        """Make what ``op`` (and the fetches it waits on) fetched so far visible; returns the
        tokens ``op`` itself made visible. Match again afterwards.

        Pages still in flight keep arriving and become visible at later polls.
        """
        self._check_prefetch(op, "finish_prefetch")
        if op is None or self.controller.prefetcher is None:
            return 0
        return self.controller.prefetcher.release(op)

    # ---- device buffers -----------------------------------------------------------------
    def _token_rows(self, locs: object, component: str | None, what: str) -> tuple[str, int]:
        """The component's name and layer count for ``write_kv``/``read_kv``; checks that its
        rows follow token slots and that this pool holds every page of ``locs``."""
        locs = _check_locs(locs, what)
        specs = {s.name: s for s in self.specs}
        name = self.specs[0].name if component is None else component
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise RequestError(
                f"{what}: component={component!r} is not one of the pool set's ({', '.join(specs)})"
            )
        if not spec.token_indexed or spec.tokens_per_row != 1:
            raise RequestError(
                f"{what}: component {name!r} ({spec.kind}, {spec.tokens_per_row} tokens a row) "
                "has no row per token slot: address it through cache.kv_buffers"
            )
        if locs.dtype.is_floating_point or locs.dtype == torch.bool or locs.dim() != 1:
            raise RequestError(
                f"{what}: locs must be a 1-D integer tensor of token slots, got "
                f"{locs.dtype} of shape {tuple(locs.shape)}"
            )
        limit = self.kv_buffers.num_pages * self.page_size
        if locs.numel() and (int(locs.min()) < 0 or int(locs.max()) >= limit):
            raise RequestError(f"{what}: locs hold a slot outside the device pool [0, {limit})")
        owned = self.kv_buffers.owned(locs)
        if owned is not None and not bool(owned.all()):
            raise RequestError(f"{what}: locs hold slots of pages another CP rank holds")
        return name, spec.num_layers

    def write_kv(
        self, locs: torch.Tensor, rows: torch.Tensor, component: str | None = None
    ) -> None:
        """Write ``rows`` (``[num_layers, len(locs), *row_shape]``) into the device buffers of
        ``component`` (the KV anchor by default; any component with one row per token) at the
        logical token slots ``locs`` (from ``alloc``): every layer at once, translated to
        physical slots here. Slots the cache owns (``load``'s) are never written."""
        self._check_open("write_kv")
        name, layers = self._token_rows(locs, component, "write_kv")
        rows = check_type(rows, torch.Tensor, "rows", "write_kv", "a torch.Tensor")
        phys = self.kv_buffers.slots(locs.to(torch.int64), name)
        want = (layers, locs.numel(), *self.kv_buffers.layer(0, name).shape[1:])
        if tuple(rows.shape) != want:
            raise RequestError(
                f"write_kv: rows must have shape {want} (layers, slots, *row_shape), "
                f"got {tuple(rows.shape)}"
            )
        for i in range(layers):
            buf = self.kv_buffers.layer(i, name)
            buf[phys.to(buf.device)] = rows[i].to(buf.device, buf.dtype)

    def read_kv(self, locs: torch.Tensor, component: str | None = None) -> torch.Tensor:
        """A copy of ``component``'s rows (the KV anchor by default) at logical token slots
        ``locs``: ``[num_layers, len(locs), *row_shape]`` on the cache's device."""
        self._check_open("read_kv")
        name, layers = self._token_rows(locs, component, "read_kv")
        phys = self.kv_buffers.slots(locs.to(torch.int64), name)
        return torch.stack(
            [self.kv_buffers.layer(i, name)[phys.to(self.device)] for i in range(layers)]
        )

    # ---- engine-owned pages -------------------------------------------------------------
    def alloc(self, num_tokens: int, at: int | None = None) -> torch.Tensor:
        """Slots of ``ceil(num_tokens / page_size)`` fresh whole pages, evicting if needed;
        ``CapacityError`` when even eviction leaves too few. ``at`` is the sequence position
        of the first of the tokens (a page boundary); under context parallelism it says
        which rank owns each page and is required. After a ``load`` that ended in a tail copy,
        ``at=len(ld.locs)`` (or no ``at``) continues the copy: its remaining slots first."""
        self._check_open("alloc")
        num_tokens = check_int(num_tokens, "num_tokens", "alloc")
        if at is not None:
            at = check_int(at, "at", "alloc")
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
        return self.engine_pages.release_window(_check_locs(locs, "release_window"))

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
        if _check_locs(locs, "free").numel():
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
        _check_tokens(tokens, "insert")
        _check_locs(locs, "insert")
        _check_checkpoints(checkpoints, "insert")
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
        _check_tokens(tokens, "finish")
        _check_locs(locs, "finish")
        prefix_len = check_int(prefix_len, "prefix_len", "finish")
        if handle is not None:
            self._check_handle(handle, "finish")
        _check_checkpoints(checkpoints, "finish")
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

    def record_prefill(
        self,
        recomputed_tokens: int,
        seconds: float | None = None,
        forward_tokens: int | None = None,
        chunks: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Count prompt tokens the engine had to compute. With ``seconds``: the forward that
        computed them took that long, for ``forward_tokens`` tokens in all (default
        ``recomputed_tokens``; a forward that also decoded counts those tokens too): a
        measurement for the prefill fit (``restore_policy='cost'`` prices recomputing with
        it). ``chunks``, when given, says what each item of the forward computed: ``(cached,
        computed)``, ``computed`` tokens after ``cached`` ones (their sum is
        ``forward_tokens``); without it the forward's tokens count as one cold prompt's. Call
        it once per forward that ran prefills, or once per admission without ``seconds``."""
        recomputed_tokens = check_int(recomputed_tokens, "recomputed_tokens", "record_prefill")
        self.metrics.inc("recomputed_tokens", recomputed_tokens)
        if seconds is None:
            if forward_tokens is not None or chunks is not None:
                raise RequestError("record_prefill: forward_tokens or chunks without seconds")
            return
        seconds = check_number(seconds, "seconds", "record_prefill")
        tokens = recomputed_tokens
        if forward_tokens is not None:
            tokens = check_int(forward_tokens, "forward_tokens", "record_prefill")
            if tokens < recomputed_tokens:
                raise RequestError(
                    f"record_prefill: forward_tokens={tokens} < recomputed_tokens="
                    f"{recomputed_tokens} (the forward computed them)"
                )
        if chunks is None:
            pairs = [(0, tokens)]
        else:
            pairs = [
                (check_int(d, "chunks", "record_prefill"), check_int(n, "chunks", "record_prefill"))
                for d, n in chunks
            ]
            if sum(n for _, n in pairs) != tokens:
                raise RequestError(
                    f"record_prefill: chunks compute {sum(n for _, n in pairs)} tokens, the "
                    f"forward {tokens}"
                )
        self.restore_cost.prefill(pairs, seconds)

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
        self.restore_cost.poll()
        if self.config.debug_checks:
            self.check_integrity()

    def in_flight(self) -> bool:
        """Whether any transfer or storage I/O is still in flight (``drain`` would wait)."""
        return self.controller.in_flight()

    def publish_events(self) -> None:
        """Publish the KV events (``CacheConfig.kv_events``) recorded since the last batch as
        one batch now; ``poll`` does so at its end. An engine calls it once a step's finished
        requests left their pages here, so that an engine going idle announces them. Never
        blocks; without ``kv_events`` it does nothing."""
        self.controller.publish_batch()

    def drain(self) -> None:
        """Wait until every transfer and storage write in flight completed and is visible."""
        self.controller.drain()

    def flush(self, host: bool = True) -> None:
        """Drop every unlocked cached page from the device tier (and the host tier when
        ``host``); storage keeps its objects. In-flight work completes first."""
        check_bool(host, "host", "flush")
        self.drain()
        self.controller.evict_device(self.device_pool.logical_pages)
        if host and self.host_pool is not None:
            self.controller.evict_host(self.host_pool.logical_pages)
        self.controller.publish_batch()

    def stats(self) -> dict:
        """Counters and pool usage (``report.cache_stats``, ``windows.window_stats``) and the
        measured rates restores are priced with (``restore_cost.STATS``: bytes per second of
        storage reads and writes and of host → device loads, prefill tokens per second)."""
        return {
            **cache_stats(self.parts),
            **window_stats(self.parts),
            **self.restore_cost.stats(),
        }

    def prometheus_registry(self):  # noqa: ANN201 - prometheus_client type, imported lazily
        """A prometheus_client registry exporting ``stats()``."""
        return prometheus_registry(self.stats)

    def check_integrity(self) -> None:
        """Every structure's invariants plus cross-structure page accounting."""
        check_cache(self.parts)
        if self.resume.window:
            check_windows(self.parts)

    def close(self) -> None:
        """Finish in-flight work (storage writes land), release the backend and stop pinning
        the host tier (``kvtier.pools.pinning``)."""
        if not self._closed:
            self._closed = True
            self.controller.close()
            if self.host_pool is not None:
                self.host_pool.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_init(config: object, specs: object) -> None:
    check_type(config, CacheConfig, "config", "TieredCache", error=ConfigError)
    if not isinstance(specs, list | tuple):
        raise ConfigError(f"TieredCache: specs must be a list of PoolSpec, got {describe(specs)}")
    for i, spec in enumerate(specs):
        check_type(spec, PoolSpec, f"specs[{i}]", "TieredCache", error=ConfigError)


def _check_tokens(tokens: object, what: str) -> None:
    """A container of token ids (list, tuple, ``array``, 1-D array or tensor); the ids
    themselves are checked where they are packed (``kvtier.tree.tokens``)."""
    if isinstance(tokens, str | bytes | bytearray) or not (
        hasattr(tokens, "__len__") and hasattr(tokens, "__getitem__")
    ):
        raise RequestError(
            f"{what}: tokens must be a sequence of token ids, got {describe(tokens)}"
        )
    ndim = getattr(tokens, "ndim", 1)
    if ndim != 1:
        raise RequestError(f"{what}: tokens must be one-dimensional, got {ndim} dimensions")


def _token_error(tokens: Sequence[int], what: str, error: RequestError) -> RequestError:
    """``error`` (the tree refused ``tokens``) naming the first id that is no integer."""
    if isinstance(tokens, list | tuple):
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                return RequestError(f"{what}: token {i} is {describe(t)}: token ids are integers")
    return RequestError(f"{what}: {error}")


def _check_locs(locs: object, what: str) -> torch.Tensor:
    return check_type(locs, torch.Tensor, "locs", what, "a torch.Tensor of token slots")


def _check_checkpoints(checkpoints: object, what: str) -> None:
    if checkpoints is not None and not (
        isinstance(checkpoints, torch.Tensor) and checkpoints.dtype == torch.bool
    ):
        raise RequestError(
            f"{what}: checkpoints must be None or a bool tensor (one per whole page), got "
            f"{describe(checkpoints)}"
        )

"""Cache configuration. Every field is validated at construction; a bad value raises
``ConfigError`` naming the option, so misconfiguration fails at start-up, not mid-request."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.errors import ConfigError

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
HOST_LAYOUTS = ("page_first", "layer_first")
EVICTION_POLICIES = ("lru", "lfu", "cost")
TRANSFER_MECHANISMS = ("auto", "kernel", "copy_engine")
COMPACTIONS = ("auto", "eager", "off")
CP_PATTERNS = ("round_robin", "zigzag")
BACKUP_TIMINGS = ("at_insert", "per_layer")
HOST_MODES = ("cache", "buffer_only")
RESTORE_POLICIES = ("always", "cost")
STORAGE_ADMISSIONS = ("all", "cost")
KV_CODECS = ("none", "fp8_e4m3", "int8")


def _choice(option: str, value: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(f"{option}={value!r} is not one of {', '.join(allowed)}")


def _integer(option: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass: True would silently mean 1
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{option} must be {what}, got {value!r}")


def _positive(option: str, value: Any) -> None:
    # nan passes every comparison-based check and inf overflows the pool sizing later
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"{option} must be a positive finite number, got {value!r}")


def _flag(option: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        none = " or None" if allow_none else ""
        raise ConfigError(f"{option} must be True or False{none}, got {value!r}")


def _text(option: str, value: Any, allow_none: bool = False, nonempty: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str) or (nonempty and not value):
        what = "a non-empty string" if nonempty else "a string"
        none = " or None" if allow_none else ""
        raise ConfigError(f"{option} must be {what}{none}, got {value!r}")


def _available_devices() -> str:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return ", ".join(["cpu", *(f"cuda:{i}" for i in range(count))])


def resolve_device(name: str | None) -> torch.device:
    """The torch device that ``CacheConfig.device`` names on this host (``None``: CUDA when
    available, else CPU).

    Checked here, at cache start, rather than at construction: a config may be built on another
    host than the one that runs it. Raises ``ConfigError`` naming ``device`` and what this host
    has when the name is no torch device, not ``cpu``/``cuda``, or a CUDA device that is absent.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    have = f"this host has {_available_devices()}"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={name!r} is not a torch device name; {have}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"device={name!r}: kvtier runs on cpu or cuda; {have}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"device={name!r} but CUDA is not available; {have}")
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"device={name!r} is beyond the {count} CUDA device(s); {have}")
    return dev


@dataclass(frozen=True)
class CacheConfig:
    """How big each tier is and how pages move between them."""

    page_size: int = 16
    """Tokens per KV page; the tree splits only on page boundaries."""
    device_pages: int = 256
    """Pages in the device (L1) pool (of each rank, under context parallelism)."""
    device: str | None = None
    """Torch device for L1: ``cuda``/``cuda:N``/``cpu``; ``None`` picks CUDA when available.
    Checked against the devices of the host that starts the cache (``resolve_device``)."""
    enable_host: bool = True
    """Keep an L2 host tier. Without it there is no L3 either."""
    host_ratio: float = 2.0
    """Host pool size as a multiple of the device pool (ignored when ``host_pages`` or
    ``host_bytes`` is set)."""
    host_pages: int | None = None
    """Host pool size in pages; overrides ``host_ratio``."""
    host_bytes: int | None = None
    """Host pool size in bytes (rounded down to whole pages); overrides ``host_ratio``."""
    host_mode: str = "cache"
    """What the host tier is: ``cache`` (a cache level: copies stay until evicted) or
    ``buffer_only`` (a staging buffer between device and storage, ``kvtier.controller.staging``:
    a backup's host copy is freed once its storage write landed, a fetched copy once it was
    loaded to device; the pool may be smaller than one request). ``buffer_only`` needs
    ``enable_host=True``, ``storage`` and ``write_policy`` ``write_through`` or
    ``write_through_selective``; it refuses ``backup_timing='per_layer'`` and ``cp_size > 1``."""
    host_layout: str = "page_first"
    """``page_first`` (one contiguous block per page: one L3 object is one memcpy) or
    ``layer_first`` (same layout as the device pool)."""
    pin_host: bool | None = None
    """Pin the host pool; ``None`` pins when CUDA is present."""
    write_policy: str = "write_through"
    """When device pages are copied to host: ``write_through`` (on insert),
    ``write_through_selective`` (once a prefix was hit ``write_threshold`` times) or
    ``write_back`` (on device eviction)."""
    write_threshold: int = 2
    """Hits before a page is backed up under ``write_through_selective``."""
    eviction_policy: str = "lru"
    """Which unlocked leaves go first when a tier is full: ``lru``, ``lfu`` or ``cost``
    (GreedyDual-Size per tier, ``kvtier.tree.eviction_order``: each copy is credited, when
    made or used, the tier's inflation value plus the work of computing its tokens again at
    their depth per byte it holds; the smallest credit goes first and becomes the inflation
    value, so pages that save little per byte and have not been used lately go first)."""
    storage: str | None = None
    """L3 backend name from the storage registry (``file``), or ``None`` for no L3."""
    storage_url: str | None = None
    """Where a networked backend lives: for ``mooncake`` a ``mooncake://MASTER:PORT?...`` URL
    or the path of a JSON file with the same settings (see ``kvtier.storage.mooncake``)."""
    storage_dir: str = "kvtier-data"
    """Directory of the ``file`` backend."""
    storage_bytes: int = 8 << 30
    """Byte budget of the ``file`` backend's directory; least recently used objects are evicted
    past it. The ranks of a context-parallel group share the directory, each within
    ``storage_bytes // cp_size``."""
    prefetch_policy: str = "timeout"
    """When a request stops waiting for L3 → host prefetch: ``best_effort`` (never waits),
    ``wait_complete`` (waits for all pages) or ``timeout`` (waits up to ``prefetch_timeout_s``)."""
    prefetch_timeout_s: float = 5.0
    """Deadline of the ``timeout`` prefetch policy."""
    prefetch_min_pages: int = 1
    """Storage hits shorter than this many pages are recomputed instead of fetched."""
    restore_policy: str = "always"
    """Whether a matched prefix is always restored (``always``: every page a tier below the
    device holds is loaded or fetched) or only where that is faster than computing it again
    (``cost``, ``kvtier.controller.restore_cost``): the time to bring the prefix up (its bytes
    at the measured rate of each tier's path, behind the bytes already queued there) against
    computing its tokens again (a forward takes the longer of its launch time and its work at
    the tokens' depth, both fitted to the forwards measured; every option pays one forward);
    the cheaper wins, or the front is restored and the rest recomputed. Rates are measured as
    pages move and forwards run (the engine reports them through
    ``TieredCache.record_prefill``; the first forward of each size, set-up, untimed), from the
    priors below until then (a tier never measured is probed at its first decline), and
    exported in ``stats()`` under both policies. ``always`` is the default because its
    decisions never depend on a clock (the same hits in every run, no collective per match
    under context parallelism); choose ``cost`` where a tier can be slower than computing
    (remote or contended storage, a slow link, a CPU engine with a fast model). Under context
    parallelism every rank must set the same policy; the group restores the least any rank
    would."""
    restore_rate_weight: float = 0.1
    """How much of each rate a new measurement replaces, in ``[0, 1]``: the byte and second
    sums behind a rate decay by ``1 - restore_rate_weight`` per measurement (1: the last one
    alone). ``0`` keeps the rates at the priors below (rates measured once, by hand)."""
    restore_storage_rate: float = 2e9
    """Storage read rate in bytes per second until one is measured (and for writes queued on
    the same I/O path until a write is)."""
    restore_load_rate: float = 1e10
    """Host → device load rate in bytes per second until one is measured."""
    restore_prefill_rate: float = 1000.0
    """Prefill rate in tokens per second (the fit's slope, ``kvtier.controller.restore_cost``)
    until the engine reports a forward. Low on purpose: until then a restore has to be very
    slow to lose."""
    storage_admission: str = "all"
    """Which host copies are written to storage: ``all`` (every one storage lacks) or ``cost``
    (``kvtier.controller.storage_admission``): a page only where computing it again (its
    tokens at their depth, at the prefill rate) takes at least as long as reading it back at
    the storage read rate, and only with every page before it that storage lacks; passed-over
    pages count in ``skipped_storage_writes``. Until a storage read was measured everything
    is written (``restore_rate_weight=0``: the priors above are the rates). Refuses
    ``cp_size > 1``."""
    model_fingerprint: str = ""
    """Identifies model weights and architecture; part of every L3 key's namespace. ``LLM``
    sets it from the model; a cache with storage refuses to start without it unless
    ``unbound_namespace`` says so."""
    unbound_namespace: bool = False
    """Accept storage without a ``model_fingerprint``: every model sharing the store (or
    ``storage_dir``) then reads the others' objects. Only for a store one model uses."""
    tenant_salt: str = ""
    """Optional salt so that tenants never share L3 objects."""
    storage_encryption: bool = False
    """Seal every storage object with AES-256-GCM under a key derived per ``tenant_salt``
    (``kvtier.storage.encrypted``): a wrong key or a tampered object is a counted miss, never
    served. Needs the ``cryptography`` package and a key (``storage_key_file`` or the
    ``KVTIER_STORAGE_KEY`` environment variable)."""
    storage_key_file: str | None = None
    """File holding the 32-byte master key of ``storage_encryption`` (raw, or 64 hex
    characters); ``None`` reads ``$KVTIER_STORAGE_KEY``. Only the path is kept here."""
    rank: int = 0
    """This process's shard (tensor/context-parallel rank) for rank-specific bytes."""
    world_size: int = 1
    """Number of shards."""
    backup_timing: str = "at_insert"
    """When ``write_through`` copies a computed page to host: ``at_insert`` (when the finished
    request hands it to the cache) or ``per_layer`` (during the forward that computes it, each
    layer as it finishes: the host copy exists when the request ends; seed 004). ``per_layer``
    needs ``write_policy='write_through'`` and a host tier; under CP each rank copies its own
    shard and the copy is visible once every rank's shard landed."""
    cp_size: int = 1
    """Ranks of the context-parallel group (1: none). Each rank holds the pages of a sequence
    that it owns; ``device_pages`` and the host pool size count one rank's pages. The tree,
    the scheduler and L3 keys are the same on every rank and independent of ``cp_size``."""
    cp_rank: int = 0
    """This process's rank in the context-parallel group, ``0 <= cp_rank < cp_size``."""
    cp_pattern: str = "round_robin"
    """Which rank owns page ``i`` of a sequence: ``round_robin`` or ``zigzag``
    (``kvtier.parallel.layout``)."""
    cache_partial_pages: bool = True
    """Cache the valid tail of a request's last, partial page when it finishes (up to one page
    minus a token fewer recomputed per shared prefix); ``False`` frees it as a whole-page cache
    does. Ignored (the tail is freed) for pool sets with a partial component, a recurrent state
    pool or sliding-window rows (``kvtier.cache.engine_pages``); under context parallelism the
    tail page has an owner like any page and is cached."""
    debug_checks: bool = False
    """Validate transfer indices (CPU tensors only) and run integrity checks on every poll."""
    backup_share: float = 0.8
    """CUDA: the share of the time between two ``cache.poll()`` calls that device → host backups
    queued at a poll may keep the link busy (``kvtier.transfer.pacer``); 0 queues every backup
    whole when it is made. Copy engines serve queued copies in order, so a small device → host
    read (a sampler's tokens) waits behind every backup byte queued before it: pacing keeps what
    a step queues within what the link moves during it (measured: rate and poll interval)."""
    transfer_mechanism: str = "auto"
    """How device ↔ host copies move (``kvtier.transfer.plan``): ``auto`` picks per batch by
    block size, ``kernel`` forces row kernels through the mapped host pool, ``copy_engine``
    forces copy engines (staged through device buffers for page-first host pools, else direct
    block lists; a CUDA driver without batched copies then fails at start). CPU caches copy
    synchronously whatever the choice."""
    compaction: str = "auto"
    """When a window pool's device arena (``kvtier.pools.unified_pool``) relocates pages to
    close its holes: ``auto`` when an allocation finds room only in pieces, ``eager`` before every
    allocation (moves pages as often as possible: for testing), ``off`` never (an allocation
    that finds room only in pieces fails, and pages are evicted instead)."""
    host_compaction: str = "off"
    """A window pool's host tier as a relocatable arena (``kvtier.pools.host_arena``): a host
    copy without window rows then takes only its anchor's bytes, and holes are closed as
    ``compaction`` says for the device (``auto``, ``eager``). ``off`` (the default): the fixed
    host pool, every page with room for every component. Needs a pool set with a window
    component and ``cp_size=1``."""
    kv_codec: str = "none"
    """How the host and storage tiers hold the attention KV anchors (``kvtier.pools.codec``):
    ``none`` (the default) exact; ``fp8_e4m3`` or ``int8`` one byte per element plus a float32
    scale per page, layer and KV head (per latent block for MLA): half of a 16-bit pool's host
    bytes, a quarter of a float32 one's, and so about twice (four times) the pages in the same
    ``host_bytes``. Lossy: the page is quantized on device → host backup and dequantized on
    host → device load, on the device (on CUDA the link carries the coded bytes; the host
    pool must be pinned). Under context parallelism each rank codes the pages it owns.
    Components not marked lossy by the model (indexer keys, recurrent state, window rows, draft
    hidden states) stay exact. Part of the L3 namespace. Refuses ``host_compaction``, and
    needs ``enable_host=True``."""
    test_completion_polls: int = 0
    """For tests only, never in production: every device <-> host copy and every storage I/O
    completes, as ``poll`` sees it, only after a random number (0 to this many) of completion
    queries more, drawn per rank from ``test_completion_seed`` and ``cp_rank``, so the ranks of
    a CP group see completions at different times (``kvtier.transfer.delays``). A poll that
    sees a storage I/O end waits for it, so a schedule of calls completes at the same polls in
    every run. 0 (the default): completions are seen as they happen."""
    test_completion_seed: int = 0
    """Seed of ``test_completion_polls``' draws (mixed with ``cp_rank``)."""
    extra_namespace: tuple[str, ...] = field(default_factory=tuple)
    """Additional strings mixed into the key namespace."""
    kv_events: str | None = None
    """ZeroMQ endpoint on which the cache publishes KV events in vLLM's format
    (``kvtier.events``, docs/kv-events.md): per tier (``device``, ``host``, ``storage``) which
    pages became resident or stopped being resident, one batch per ``poll``. As in vLLM, an
    endpoint with a wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://`` is bound, any other
    (``tcp://127.0.0.1:5557``) connected to. ``None`` (the default): no events. Needs the
    ``events`` extra (pyzmq, msgpack)."""
    kv_events_replay: str | None = None
    """ZeroMQ endpoint bound for replay requests: a client sends an 8-byte big-endian sequence
    number and gets every buffered batch from it on, then an end marker. Needs ``kv_events``."""
    kv_events_instance: str = ""
    """This instance's id, sent as the ZeroMQ topic of every batch (where vLLM's format has no
    slot for it); empty: ``<hostname>:<pid>``."""
    kv_events_queue: int = 1000
    """Batches that may wait for the publisher thread; when it is full, a step's batch is
    dropped and its events counted in ``kv_events_dropped`` (publishing never blocks)."""
    kv_events_buffer: int = 10_000
    """Batches kept for replay."""

    def _check_events(self) -> None:
        schemes = ("tcp://", "ipc://", "inproc://")
        for opt in ("kv_events", "kv_events_replay"):
            value = getattr(self, opt)
            _text(opt, value, allow_none=True, nonempty=True)
            if value is not None and not value.startswith(schemes):
                raise ConfigError(
                    f"{opt}={value!r} is not a ZeroMQ endpoint ({', '.join(schemes)}...)"
                )
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("kv_events_replay needs kv_events (the endpoint events go to)")
        _text("kv_events_instance", self.kv_events_instance)
        _integer("kv_events_queue", self.kv_events_queue, 1)
        _integer("kv_events_buffer", self.kv_events_buffer, 1)

    def __post_init__(self) -> None:
        for opt in ("page_size", "device_pages", "write_threshold", "storage_bytes"):
            _integer(opt, getattr(self, opt), 1)
        _text("device", self.device, allow_none=True, nonempty=True)
        _flag("enable_host", self.enable_host)
        _flag("cache_partial_pages", self.cache_partial_pages)
        _positive("host_ratio", self.host_ratio)
        _integer("host_pages", self.host_pages, 1, allow_none=True)
        _integer("host_bytes", self.host_bytes, 1, allow_none=True)
        if self.host_pages is not None and self.host_bytes is not None:
            raise ConfigError(
                f"host_pages={self.host_pages} and host_bytes={self.host_bytes} both size the "
                "host pool: set at most one"
            )
        _choice("host_layout", self.host_layout, HOST_LAYOUTS)
        _flag("pin_host", self.pin_host, allow_none=True)
        _choice("write_policy", self.write_policy, WRITE_POLICIES)
        _choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        _choice("transfer_mechanism", self.transfer_mechanism, TRANSFER_MECHANISMS)
        _choice("compaction", self.compaction, COMPACTIONS)
        _choice("host_compaction", self.host_compaction, COMPACTIONS)
        # '' would read as "no L3" in some places and as a backend name in others
        _text("storage", self.storage, allow_none=True, nonempty=True)
        _text("storage_url", self.storage_url, allow_none=True, nonempty=True)
        # '' is the current directory: the file backend would write into wherever it runs
        _text("storage_dir", self.storage_dir, nonempty=True)
        _choice("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        _positive("prefetch_timeout_s", self.prefetch_timeout_s)
        _integer("prefetch_min_pages", self.prefetch_min_pages, 1)
        _choice("restore_policy", self.restore_policy, RESTORE_POLICIES)
        _choice("storage_admission", self.storage_admission, STORAGE_ADMISSIONS)
        weight = self.restore_rate_weight
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
            or not 0 <= weight <= 1
        ):
            raise ConfigError(f"restore_rate_weight must be a number in [0, 1], got {weight!r}")
        for opt in ("restore_storage_rate", "restore_load_rate", "restore_prefill_rate"):
            _positive(opt, getattr(self, opt))
        _text("model_fingerprint", self.model_fingerprint)
        _text("tenant_salt", self.tenant_salt)
        _flag("storage_encryption", self.storage_encryption)
        self._check_events()
        _text("storage_key_file", self.storage_key_file, allow_none=True, nonempty=True)
        if self.storage_encryption and self.storage is None:
            raise ConfigError("storage_encryption=True needs a storage backend (storage=...)")
        _integer("world_size", self.world_size, 1)
        _integer("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ConfigError(f"rank={self.rank} must lie in [0, world_size={self.world_size})")
        _choice("backup_timing", self.backup_timing, BACKUP_TIMINGS)
        if self.backup_timing == "per_layer" and (
            self.write_policy != "write_through" or not self.enable_host
        ):
            raise ConfigError(
                f"backup_timing='per_layer' needs write_policy='write_through' and "
                f"enable_host=True (got write_policy={self.write_policy!r}, "
                f"enable_host={self.enable_host})"
            )
        _integer("cp_size", self.cp_size, 1)
        _integer("cp_rank", self.cp_rank, 0)
        if self.cp_rank >= self.cp_size:
            raise ConfigError(f"cp_rank={self.cp_rank} must lie in [0, cp_size={self.cp_size})")
        _choice("cp_pattern", self.cp_pattern, CP_PATTERNS)
        if self.host_compaction != "off" and (self.cp_size > 1 or not self.enable_host):
            raise ConfigError(
                f"host_compaction={self.host_compaction!r} needs enable_host=True and cp_size=1 "
                f"(got enable_host={self.enable_host}, cp_size={self.cp_size}): a relocatable "
                "host pool has one lane"
            )
        self._check_kv_codec()
        if self.storage_admission == "cost" and self.cp_size > 1:
            raise ConfigError(
                f"storage_admission='cost' with cp_size={self.cp_size} is not supported: the "
                "ranks of a CP group would decide from their own rates; use "
                "storage_admission='all'"
            )
        _flag("debug_checks", self.debug_checks)
        _integer("test_completion_polls", self.test_completion_polls, 0)
        _integer("test_completion_seed", self.test_completion_seed, 0)
        _flag("unbound_namespace", self.unbound_namespace)
        share = self.backup_share
        if (
            isinstance(share, bool)
            or not isinstance(share, int | float)
            or not math.isfinite(share)
            or not 0 <= share <= 1
        ):
            raise ConfigError(f"backup_share must be a number in [0, 1], got {share!r}")
        ns = self.extra_namespace
        if not isinstance(ns, tuple) or not all(isinstance(x, str) for x in ns):
            raise ConfigError(f"extra_namespace must be a tuple of strings, got {ns!r}")
        if self.storage == "mooncake" and not self.storage_url:
            raise ConfigError("storage='mooncake' needs storage_url (mooncake://MASTER:PORT?...)")
        if self.storage is not None and not self.enable_host:
            raise ConfigError("storage requires enable_host=True: L3 moves pages through L2")
        if self.write_policy == "write_back" and not self.enable_host:
            raise ConfigError("write_policy='write_back' requires enable_host=True")
        self._check_host_mode()

    def _check_kv_codec(self) -> None:
        _choice("kv_codec", self.kv_codec, KV_CODECS)
        if self.kv_codec == "none":
            return
        codec = f"kv_codec={self.kv_codec!r}"
        if not self.enable_host:
            raise ConfigError(
                f"{codec} needs enable_host=True: it compresses the host and storage tiers"
            )
        if self.host_compaction != "off":
            raise ConfigError(
                f"{codec} with host_compaction={self.host_compaction!r} is not supported: the "
                "relocatable host arena needs every component's one-layer page to have the "
                "same bytes; use host_compaction='off' or kv_codec='none'"
            )

    def _check_host_mode(self) -> None:
        _choice("host_mode", self.host_mode, HOST_MODES)
        if self.host_mode != "buffer_only":
            return
        mode = "host_mode='buffer_only'"
        if not self.enable_host:
            raise ConfigError(f"{mode} requires enable_host=True: the host tier is the buffer")
        if self.storage is None:
            raise ConfigError(
                f"{mode} requires storage (e.g. storage='file'): a staged page is kept nowhere "
                "but in storage"
            )
        if self.write_policy == "write_back":
            # Write-back copies a page only when its device copy is evicted, and eviction
            # cannot wait for host room that storage writes free later.
            raise ConfigError(
                f"{mode} with write_policy='write_back' is not supported: use write_through "
                "or write_through_selective"
            )
        if self.backup_timing == "per_layer":
            raise ConfigError(
                f"{mode} with backup_timing='per_layer' is not supported: per-layer backups "
                "reserve host pages for a whole forward outside the staging accounting"
            )
        if self.cp_size > 1:
            raise ConfigError(
                f"{mode} with cp_size={self.cp_size} is not supported yet: the staging "
                "chunks count pages of one rank's pool"
            )

    def resolve_host_pages(self, page_bytes: int) -> int:
        """Host pool size in pages given one page's byte size across all pools.

        Raises ``ConfigError`` when the host tier is too small for the write policy.
        """
        if self.host_pages is not None:
            pages, opt = self.host_pages, "host_pages"
        elif self.host_bytes is not None:
            pages, opt = self.host_bytes // page_bytes, "host_bytes"
        else:
            pages, opt = int(self.device_pages * self.host_ratio), "host_ratio"
        if pages < 1:
            raise ConfigError(
                f"{opt} gives a host pool of {pages} pages; it must hold at least one"
            )
        if self.write_policy == "write_back" and pages < self.device_pages:
            raise ConfigError(
                f"{opt} gives {pages} host pages but write_policy='write_back' needs the host tier "
                f"to hold the device pool's {self.device_pages} pages"
            )
        return pages

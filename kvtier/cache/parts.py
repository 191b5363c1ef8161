"""What a ``TieredCache`` is made of, built once from its configuration: the pools (by the pool
set's kinds and the context-parallel layout), the storage backend (capabilities checked before
use), the tree, the controller and the engine-page ledger. ``CacheParts`` is what the report and
the window rules read; the facade only routes calls to its parts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.cache.engine_pages import EnginePages
from kvtier.cache.ranks import check_group
from kvtier.cache.resume import Resume
from kvtier.cache.tail_copy import copy_page
from kvtier.cache.windows import check_window_config
from kvtier.config import CacheConfig, resolve_device
from kvtier.controller import Controller
from kvtier.controller.restore_cost import CostModel
from kvtier.controller.storage_admission import StorageAdmission
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, cache_namespace
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.parallel.layout import CPLayout
from kvtier.pools.codec import get_codec, host_page_bytes
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.host_arena import HostArena
from kvtier.pools.spec import PoolSpec, tree_page_size, validate_pool_set
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.storage.base import StorageBackend
from kvtier.storage.registry import check_capabilities, create_backend
from kvtier.transfer.translate import DeviceKV, PageTranslator, device_view
from kvtier.tree.eviction_order import make_policy
from kvtier.tree.radix import RadixTree
from kvtier.tree.recompute import RecomputeWork


@dataclass(slots=True)
class Pools:
    """A cache's pools and the page translation the CP layout implies."""

    device: DevicePool | UnifiedPool
    host: HostPool | HostArena | None
    translator: PageTranslator | None
    """The caller's translator, or the CP layout's when ``cp_size > 1``."""
    on_device: Callable[[torch.Tensor], torch.Tensor] | None
    """A window pool: which device pages hold window rows (the arena says); else ``None``."""


def build_pools(
    config: CacheConfig,
    specs: Sequence[PoolSpec],
    page_size: int,
    device: torch.device,
    window: bool,
    translator: PageTranslator | None,
) -> Pools:
    """The device pool (a ``UnifiedPool`` arena when the set has a ``window`` pool), the host
    pool when ``config.enable_host`` (holding ``config.kv_codec``'s host specs, sized by their
    page bytes), and under CP the layout's translator."""
    cp = config.cp_size
    on_device = None
    dev: DevicePool | UnifiedPool
    if window:
        dev = UnifiedPool(specs, config.device_pages, page_size, device, config.compaction)
        on_device = dev.has_window
    else:
        dev = DevicePool(specs, config.device_pages, page_size, device, cp)
    host = None
    codec = get_codec(config.kv_codec)
    if config.enable_host:
        pin = config.pin_host if config.pin_host is not None else torch.cuda.is_available()
        # Sized by the host's own page bytes: a coded pool fits more pages in ``host_bytes``.
        page_bytes = (
            dev.page_bytes if codec.dtype is None else host_page_bytes(specs, codec, page_size)
        )
        pages = config.resolve_host_pages(page_bytes)
        if config.host_compaction != "off":
            if not window:
                raise ConfigError(
                    f"host_compaction={config.host_compaction!r} needs a pool set with a window "
                    "component (without one every host page has the same bytes)"
                )
            comp = config.host_compaction
            host = HostArena(specs, pages, page_size, config.host_layout, pin, comp)
        else:
            host = HostPool(specs, pages, page_size, config.host_layout, pin, cp, codec)
    if cp > 1:
        layout = CPLayout(cp, config.cp_rank, config.cp_pattern)
        host_pages = host.num_pages if host is not None else 0
        translator = layout.translator(config.device_pages, host_pages)
    return Pools(dev, host, translator, on_device)


def open_backend(
    config: CacheConfig, namespace: Namespace, page_size: int
) -> StorageBackend | None:
    """The configured storage backend (``None`` without ``config.storage``), closed again if
    it lacks a capability the configuration needs (``ConfigError`` naming it)."""
    if not config.storage:
        return None
    backend = create_backend(config.storage, config, namespace)
    try:
        check_capabilities(backend, config, page_size)
    except ConfigError:
        backend.close()
        raise
    return backend


@dataclass(slots=True)
class CacheParts:
    """Everything one ``TieredCache`` owns, each piece built once (``build_parts``)."""

    config: CacheConfig
    specs: tuple[PoolSpec, ...]
    page_size: int
    """Tokens per tree page: the allocation, tree and storage unit (contract 6)."""
    resume: Resume
    """What resuming a prefix needs besides KV pages (a checkpoint, a window's rows)."""
    device: torch.device
    group: Group
    """The CP group this rank belongs to (a one-rank group without context parallelism)."""
    device_pool: DevicePool | UnifiedPool
    host_pool: HostPool | None
    on_device: Callable[[torch.Tensor], torch.Tensor] | None
    """A window pool: which device pages hold window rows (the arena says)."""
    namespace: Namespace
    metrics: Metrics
    tree: RadixTree
    kv_buffers: DeviceKV
    """What the engine reads and writes: device buffers by physical slot."""
    controller: Controller
    engine_pages: EnginePages
    rates: CostModel
    """The measured rates restores are priced with and storage admission reads."""


def build_parts(
    config: CacheConfig,
    specs: Sequence[PoolSpec],
    translator: PageTranslator | None,
    group: Group | None,
) -> CacheParts:
    """Validate the pool set and the CP group against ``config`` and build every part
    (``ConfigError`` naming the option that does not fit)."""
    validate_pool_set(specs)
    checked = check_group(config, specs, group, translator)
    ps = tree_page_size(config.page_size, specs)
    resume = Resume.of(specs)
    device = resolve_device(config.device)
    cp = config.cp_size
    check_window_config(config, specs, translator)
    pools = build_pools(config, specs, ps, device, resume.window > 0, translator)
    namespace = cache_namespace(config, specs, ps)
    metrics = Metrics()
    work = RecomputeWork.from_specs(specs)
    page_bytes = {"device": pools.device.page_bytes, "host": pools.device.page_bytes}
    if pools.host is not None:
        page_bytes["host"] = pools.host.page_bytes
    policy = make_policy(config.eviction_policy, work, page_bytes, ps)
    tree = RadixTree(ps, policy, host_flags=resume.window > 0)
    rates = CostModel.from_config(config, work)
    admission = StorageAdmission(config.storage_admission == "cost", work, rates, ps, metrics)
    translator, kv_buffers = device_view(
        pools.translator, pools.device, pools.host, group if cp > 1 else None
    )
    backend = open_backend(config, namespace, ps)
    controller = Controller(
        config,
        tree,
        pools.device,
        pools.host,
        backend,
        namespace,
        metrics,
        translator,
        checked,
        admission,
    )
    engine_pages = EnginePages(
        pools.device,
        tree,
        controller.alloc_device_at,
        controller.on_insert,
        resume.partial,
        controller.released,
        # A tail would need a copy of the partial component, which is not supported: state
        # and window pools free the tail (page-aligned cache). Under CP the tail page has an
        # owner like any page, and its copy is allocated on the same lane (``copy_page``).
        tails=config.cache_partial_pages and not resume.partial,
        release=controller.release_replaced,
        copy_page=lambda src, dst: copy_page(pools.device, translator, src, dst),
        on_windows=controller.on_windows,
    )
    return CacheParts(
        config,
        tuple(specs),
        ps,
        resume,
        device,
        checked,
        pools.device,
        pools.host,
        pools.on_device,
        namespace,
        metrics,
        tree,
        kv_buffers,
        controller,
        engine_pages,
        rates,
    )

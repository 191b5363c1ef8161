"""The pieces ``TieredCache`` is built from: its pools (by the pool set's kinds and the
context-parallel layout) and its storage backend (capabilities checked before use)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.parallel.layout import CPLayout
from kvtier.pools.arena import UnifiedPool
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.storage.base import StorageBackend
from kvtier.storage.registry import check_capabilities, create_backend
from kvtier.transfer.translate import PageTranslator


@dataclass(slots=True)
class Pools:
    """A cache's pools and the page translation the CP layout implies."""

    device: DevicePool | UnifiedPool
    host: HostPool | None
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
    pool when ``config.enable_host``, and under CP the layout's translator."""
    cp = config.cp_size
    on_device = None
    dev: DevicePool | UnifiedPool
    if window:
        dev = UnifiedPool(specs, config.device_pages, page_size, device, config.compaction)
        on_device = dev.has_window
    else:
        dev = DevicePool(specs, config.device_pages, page_size, device, cp)
    host = None
    if config.enable_host:
        pin = config.pin_host if config.pin_host is not None else torch.cuda.is_available()
        pages = config.resolve_host_pages(dev.page_bytes)
        host = HostPool(specs, pages, page_size, config.host_layout, pin, cp)
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

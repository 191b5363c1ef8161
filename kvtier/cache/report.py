"""What a ``TieredCache`` reports about itself: its counters and pool usage (``stats``), and
the check of every structure's invariants plus the page accounting across them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import IntegrityError

if TYPE_CHECKING:
    from kvtier.cache import TieredCache


def cache_stats(cache: TieredCache) -> dict:
    """Counters (``kvtier.metrics``), pool usage and storage errors by kind."""
    snap: dict = cache.controller.metrics.snapshot()
    dev, host = cache.device_pool, cache.host_pool
    snap.update(
        device_pages_total=dev.logical_pages,
        device_pages_used=dev.allocator.used,
        device_pages_cached=cache.tree.held_pages("device").numel(),
        device_pages_engine=cache.engine_pages.count,
        host_pages_total=host.logical_pages if host else 0,
        host_pages_used=host.allocator.used if host else 0,
        host_bytes_total=host.nbytes if host else 0,
        host_bytes_used=_host_pages_here(cache) * host.page_bytes if host else 0,
        tree_nodes=sum(1 for _ in cache.tree.nodes()),
    )
    snap.update(_staging_stats(cache))
    if cache.storage is not None:
        snap["storage_errors"] = dict(cache.storage.errors)
        snap.update({f"storage_{k}": v for k, v in cache.storage.stats().items()})
    return snap


def _staging_stats(cache: TieredCache) -> dict[str, int]:
    """``host_mode='buffer_only'``: host pages staged for writes (backup copies in flight and
    host copies with a storage write in flight) and for reads (fetched pages not yet visible
    and host-only copies awaiting their load), plus the staging counters. Empty otherwise."""
    ctl = cache.controller
    staging, backups = ctl.staging, ctl.backups
    if staging is None or backups is None:
        return {}
    writing = {id(sp.node) for sp in ctl.io.pinned()} if ctl.io is not None else set()
    write = backups.inflight_host_pages()
    read = ctl.prefetcher.pending_host_pages() if ctl.prefetcher is not None else 0
    for node in cache.tree.nodes():
        if node.host is None:
            continue
        if id(node) in writing:
            write += node.host.numel()
        elif node.device is None:
            read += node.host.numel()
    return staging.stats(write, read)


def _host_pages_here(cache: TieredCache) -> int:
    """Host pages in use in this process's pool (this rank's lane under CP)."""
    alloc = cache.host_pool.allocator  # type: ignore[union-attr]
    if alloc.lanes == 1:
        return alloc.used
    return alloc.num_pages // alloc.lanes - alloc.available_in(cache.config.cp_rank)


def check_cache(cache: TieredCache) -> None:
    """Every structure's invariants plus cross-structure page accounting."""
    cache.tree.check_integrity()
    cache.device_pool.check_integrity()
    cache.engine_pages.check_integrity()
    cache.controller.check_integrity()
    host = cache.host_pool
    if host is not None:
        host.check_integrity()
        held = cache.tree.held_pages("host").numel()
        flying = cache.controller.inflight_host_pages()
        if host.allocator.used != held + flying:
            raise IntegrityError(
                f"host pages: {host.allocator.used} used != {held} cached + {flying} in flight"
            )

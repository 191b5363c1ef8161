"""What a ``TieredCache`` reports about itself: its counters and pool usage (``stats``, with a
window pool's arena figures), and the check of every structure's invariants plus the page
accounting across them (and a window pool's per-page flags)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.cache.windows import window_spec
from kvtier.errors import IntegrityError
from kvtier.pools.host_arena import HostArena

if TYPE_CHECKING:
    from kvtier.cache.parts import CacheParts


def cache_stats(parts: CacheParts) -> dict:
    """Counters (``kvtier.metrics``), pool usage and storage errors by kind."""
    snap: dict = parts.controller.metrics.snapshot()
    dev, host = parts.device_pool, parts.host_pool
    snap.update(
        device_pages_total=dev.logical_pages,
        device_pages_used=dev.allocator.used,
        device_pages_cached=parts.tree.held_pages("device").numel(),
        device_pages_engine=parts.engine_pages.count,
        host_pages_total=host.logical_pages if host else 0,
        host_pages_used=host.allocator.used if host else 0,
        host_bytes_total=host.nbytes if host else 0,
        host_bytes_used=_host_pages_here(parts) * host.page_bytes if host else 0,
        host_pages_ready=host.pages_ready if host else 0,
        host_pin_seconds=host.pin_seconds if host else 0.0,
        tree_nodes=sum(1 for _ in parts.tree.nodes()),
    )
    if isinstance(host, HostArena):
        snap.update(
            host_bytes_used=host.bytes_used,
            host_window_pages=int(host.window_pages),
            host_compactions=host.compactions,
            host_pages_relocated=host.relocated,
        )
    snap.update(_staging_stats(parts))
    if parts.controller.storage is not None:
        snap["storage_errors"] = dict(parts.controller.storage.errors)
        snap.update({f"storage_{k}": v for k, v in parts.controller.storage.stats().items()})
    return snap


def _staging_stats(parts: CacheParts) -> dict[str, int]:
    """``host_mode='buffer_only'``: host pages staged for writes (backup copies in flight and
    host copies with a storage write in flight) and for reads (fetched pages not yet visible
    and host-only copies awaiting their load), plus the staging counters. Empty otherwise."""
    ctl = parts.controller
    staging, backups = ctl.staging, ctl.backups
    if staging is None or backups is None:
        return {}
    writing = {id(sp.node) for sp in ctl.io.pinned()} if ctl.io is not None else set()
    write = backups.inflight_host_pages()
    read = ctl.prefetcher.pending_host_pages() if ctl.prefetcher is not None else 0
    for node in parts.tree.nodes():
        if node.host is None:
            continue
        if id(node) in writing:
            write += node.host.numel()
        elif node.device is None:
            read += node.host.numel()
    return staging.stats(write, read)


def _host_pages_here(parts: CacheParts) -> int:
    """Host pages in use in this process's pool (this rank's lane under CP)."""
    alloc = parts.host_pool.allocator  # type: ignore[union-attr]
    if alloc.lanes == 1:
        return alloc.used
    lane_pages = (alloc.num_pages - alloc.pending) // alloc.lanes
    return lane_pages - alloc.available_in(parts.config.cp_rank)


def check_cache(parts: CacheParts) -> None:
    """Every structure's invariants plus cross-structure page accounting."""
    parts.tree.check_integrity()
    parts.device_pool.check_integrity()
    parts.engine_pages.check_integrity()
    parts.controller.check_integrity()
    host = parts.host_pool
    if host is not None:
        host.check_integrity()
        held = parts.tree.held_pages("host").numel()
        flying = parts.controller.inflight_host_pages()
        if host.allocator.used != held + flying:
            raise IntegrityError(
                f"host pages: {host.allocator.used} used != {held} cached + {flying} in flight"
            )


def check_windows(parts: CacheParts) -> None:
    """Every node keeps one flag per page; in a relocatable host arena every flagged host
    page holds its window envelope."""
    host = parts.host_pool if isinstance(parts.host_pool, HostArena) else None
    for node in parts.tree.nodes():
        if node is parts.tree.root:
            continue
        pages = node.num_pages(parts.page_size)
        if node.ckpt is None or node.ckpt.numel() != pages:
            raise IntegrityError(f"{node!r}: window flags missing or not one per page")
        if host is not None and node.host is not None:
            lost = node.ckpt[: node.host.numel()] & ~host.has_window(node.host)
            if bool(lost.any()):
                p = int(node.host[lost][0])
                raise IntegrityError(f"{node!r}: host page {p} is flagged but has no window rows")


def window_stats(parts: CacheParts) -> dict:
    """Device bytes in use, and the arena's figures under a window pool."""
    pool = parts.device_pool
    if window_spec(parts.specs) is None:
        return {
            "device_bytes_total": pool.num_pages * pool.page_bytes,
            "device_bytes_used": pool.allocator.used * pool.page_bytes,
        }
    return {
        "device_bytes_total": pool.bytes_total,
        "device_bytes_used": pool.bytes_used,
        "device_window_pages": int(pool.window_pages),
        "device_compactions": pool.compactions,
        "device_pages_relocated": pool.relocated,
    }

"""Window pools under the cache: which configurations support them, and the hand-over of window
rows between the engine's pages and cached ones (their figures and invariants: ``report``).

A pool set with a ``window`` component (sliding-window layers) lives in a ``UnifiedPool``: the
anchor and the window component share one byte arena, a page's window rows exist only while a
query's window may read them, and the arena may relocate pages
(``kvtier.pools.unified_pool``).

Who knows where a page's window rows are (one owner per tier):

    device    the arena (``UnifiedPool.has_window``): rows come with a fresh page and go when
              the engine's queries leave them behind (``TieredCache.release_window``)
    host      ``Node.ckpt`` per page: a backup copies the rows the device page has, a load
              binds rows only for the flagged pages, a fetch flags the window objects it got
    storage   a window object per page (``keys.state_key``), written for the flagged pages
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import ConfigError
from kvtier.pools.spec import PoolSpec

if TYPE_CHECKING:
    from kvtier.config import CacheConfig
    from kvtier.pools.unified_pool import UnifiedPool
    from kvtier.tree.node import Node
    from kvtier.tree.radix import RadixTree


def window_spec(specs: Sequence[PoolSpec]) -> PoolSpec | None:
    """The window component of a pool set, if it has one."""
    return next((s for s in specs if s.kind == "window"), None)


def check_window_config(config: CacheConfig, specs: Sequence[PoolSpec], translator: object) -> None:
    """Raise ``ConfigError`` for what a window pool does not support (yet), naming the option."""
    win = window_spec(specs)
    if win is None:
        return
    why = None
    if config.cp_size > 1:
        why = f"cp_size={config.cp_size}: context parallelism does not shard a window pool"
    elif config.backup_timing == "per_layer":
        why = "backup_timing='per_layer': per-layer backups copy anchor layers of fixed pages"
    elif translator is not None:
        why = "a translator: the unified arena is the device side's own translator"
    elif any(s.kind == "state" for s in specs):
        why = "a state pool"
    if why is not None:
        raise ConfigError(
            f"the window pool {win.name!r} (sliding-window layers in a unified arena) does not "
            f"support {why}; use the defaults or a model without a window pool"
        )


def hand_over_windows(
    tree: RadixTree,
    pool: UnifiedPool,
    engine_owned: torch.Tensor,
    tokens: Sequence[int],
    pages: torch.Tensor,
) -> list[Node]:
    """Cached device pages of ``tokens`` without window rows take those of ``pages``, the
    engine's duplicates of them (the same tokens at the same positions, computed again), so
    hits can resume there again; the arena reassigns the rows, nothing is copied. Returns the
    nodes that took rows (their host copies may want them: ``WindowBackups``)."""
    m = tree.match(tokens)
    cached, spans, pos = [], [], 0
    for i, node in enumerate(m.path):
        if node.device is None:
            break
        k = m.last_pages if i == len(m.path) - 1 else node.num_pages(tree.page_size)
        # a backup reading the node copies the rows its pages had when it began: leave it be
        cached.append(node.device[:k] if not node.device_io else torch.full((k,), -1))
        spans.append((node, pos, pos + k))
        pos += k
    if not cached:
        return []
    theirs = torch.cat(cached)
    n = min(theirs.numel(), pages.numel())
    mine, theirs = pages[:n], theirs[:n]
    idx = torch.nonzero((theirs >= 0) & (mine != theirs) & engine_owned[mine]).reshape(-1)
    idx = idx[pool.has_window(mine[idx]) & ~pool.has_window(theirs[idx])]
    if not idx.numel():
        return []
    pool.move_window(mine[idx], theirs[idx])
    took = torch.zeros(n, dtype=torch.bool)
    took[idx] = True
    return [node for node, lo, hi in spans if bool(took[lo:hi].any())]


def give_back_windows(pool: UnifiedPool, pages: torch.Tensor) -> int:
    """Release the window rows those of the engine's ``pages`` still have; returns how many."""
    pages = pages[pool.has_window(pages)]
    if pages.numel():
        pool.release_window(pages)
    return pages.numel()

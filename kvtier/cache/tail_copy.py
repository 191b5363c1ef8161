"""Partial tails at the device pool: the copy page a served tail is handed out as (the tree has
the match/insert table; the controller frees tails the tree replaced).

Lengths (``MatchResult``,
``LoadResult``) count valid tokens. When ``load`` serves a prefix ending in a cached partial
tail of ``r`` tokens, its last ``r`` slots are a *tail copy*: a fresh engine page holding a
device copy of the tail page, so the request appends in place (``alloc(k, at=len(ld.locs))``
returns the copy's remaining slots, then fresh pages) and the shared tail is never written.
If no page can be had for the copy, ``load`` serves the whole pages before the tail. At
``finish`` the copy is the request's page: extending the tail replaces it in the tree (the
old tail is freed when unlocked and idle, else the copy is freed like a duplicate);
``unlock`` without ``finish`` frees a copy no ``alloc`` continued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.errors import IntegrityError

if TYPE_CHECKING:
    from kvtier.cache.engine_pages import EnginePages
    from kvtier.pools.device import DevicePool
    from kvtier.transfer.translate import PageTranslator


def copy_page(pool: DevicePool, translator: PageTranslator, src: int, dst: int) -> None:
    """Device → device copy of every component's rows of logical page ``src`` to ``dst``
    (the padding slots too: harmless, and one contiguous copy per component).

    Under context parallelism the copy is made on the lane that holds the tail: ``dst`` must
    have been allocated there (the same sequence page, so the same owner). The owner rank
    copies; every other rank holds neither page and copies nothing. A ``dst`` on another
    lane than ``src`` is a bug upstream (the copy would sit where no rank reads it) and
    raises ``IntegrityError`` naming both pages."""
    pages = torch.tensor([src, dst], dtype=torch.int64)
    owned = translator.device_owned(pages)
    if owned is not None:
        here, there = bool(owned[0]), bool(owned[1])
        if here != there:
            raise IntegrityError(
                f"tail copy: page {dst} is on another rank's lane than the tail page {src} "
                "it copies (a tail copy must be allocated on the tail's owner lane)"
            )
        if not here:
            return
    s, d = translator.device_physical(pages).tolist()
    for spec in pool.specs:
        buf = pool.buffers[spec.name]
        rows = spec.rows_per_page(pool.page_size)
        buf[:, d * rows : (d + 1) * rows].copy_(buf[:, s * rows : (s + 1) * rows])


def with_tail_copy(
    pages: EnginePages, locs: torch.Tensor, layer_events: list | None, device: torch.device
) -> tuple[torch.Tensor, int] | None:
    """``locs`` (a loaded prefix ending in a partial page) with that page's slots replaced by
    a tail copy's, and the copy page; ``None`` when no device page can be had for it."""
    ps, n = pages.page_size, locs.numel()
    if layer_events:
        # The tail may still be arriving from host on the transfer stream.
        torch.cuda.current_stream(device).wait_event(layer_events[-1])
    copy = pages.tail_copy(int(locs[-1]) // ps, n)
    if copy is None:
        return None
    out = locs.clone()
    out[n - n % ps :] = torch.arange(copy * ps, copy * ps + n % ps, dtype=out.dtype)
    return out, copy

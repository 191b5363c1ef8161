"""Leases the storage I/O holds on a relocatable host arena's pages, and the frees they defer.

A storage write reads host pages on the I/O thread and a fetch writes into them; meanwhile the
main thread may compact the arena. Each holds a lease on its pages (``HostArena.lease``) from
the moment it is submitted to the moment nothing can touch the pages any more: a write when it
was reaped, or, when the backend abandoned a call by timeout that may still read them
(``StorageBackend.write_fence``), once that call ended; a fetch's pages when they were
committed to the tree or, never arriving, freed. A page the tree lets go of while a lease is
still held (its write was reaped but a late call still reads it) is freed when the lease goes.

For a fixed ``HostPool`` nothing moves: every method is a no-op and frees happen at once.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvtier.pools.host_arena import HostArena


class HostLeases:
    """The one owner of the storage I/O's leases on ``host`` (a ``HostArena``; any other
    pool makes this a pass-through)."""

    def __init__(self, host: object) -> None:
        self.arena = host if isinstance(host, HostArena) else None
        self._fenced: list[tuple[Future, torch.Tensor]] = []
        """Leases kept until a late backend call ended: ``(fence, pages)``."""
        self._free_later: list[torch.Tensor] = []
        """Pages the tree let go of while leased: freed once no lease is left on them."""

    def hold(self, pages: torch.Tensor) -> None:
        """One lease on each of ``pages`` (a storage call is about to use them)."""
        if self.arena is not None and pages.numel():
            self.arena.lease(pages)

    def drop(self, pages: torch.Tensor, fence: Future | None = None) -> None:
        """The call that held ``pages`` ended; with a ``fence`` a call it abandoned may still
        use them until the fence completes, so the leases go then (at :meth:`poll`)."""
        if self.arena is None or not pages.numel():
            return
        if fence is not None and not fence.done():
            self._fenced.append((fence, pages))
            return
        self.arena.unlease(pages)

    def free(self, pages: torch.Tensor, free: Callable[[torch.Tensor], None]) -> None:
        """Free ``pages`` with ``free`` (the allocator's); those still leased later."""
        if self.arena is None or not pages.numel():
            free(pages)
            return
        held = self.arena.lease_count(pages) > 0
        if bool(held.any()):
            self._free_later.append(pages[held])
            pages = pages[~held]
        if pages.numel():
            free(pages)

    def poll(self, free: Callable[[torch.Tensor], None]) -> None:
        """Drop the leases whose fences completed and free what waited for them."""
        if self.arena is None:
            return
        keep = []
        for fence, pages in self._fenced:
            if fence.done():
                self.arena.unlease(pages)
            else:
                keep.append((fence, pages))
        self._fenced = keep
        waiting, self._free_later = self._free_later, []
        for pages in waiting:
            self.free(pages, free)

    @property
    def deferred_pages(self) -> int:
        """Pages freed by the tree and still waiting for a lease to go."""
        return sum(p.numel() for p in self._free_later)

    def busy(self) -> bool:
        """Whether a lease still waits for a late call."""
        return bool(self._fenced)

"""The ``PageAllocator`` interface of a ``UnifiedPool``: what the controller allocates through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import IntegrityError
from kvtier.pools import envelopes as env

if TYPE_CHECKING:
    from kvtier.pools.arena import UnifiedPool


class ArenaAllocator:
    """Logical page ids of a unified pool, each allocated with an envelope of every component.

    ``available`` is the largest ``n`` that ``alloc(n)`` serves now (compaction as the pool's
    mode says, leased envelopes fixed): the controller evicts ``n - available`` pages and then
    allocates. It is exact and costs O(1) except while pages are leased under a compacting
    mode: then it is the bound free units allow (``optimistic``), since the exact count means
    simulating the placement around the leased envelopes on every read (hundreds of
    milliseconds at 10^4 pages); the controller evicts more when an allocation it was promised
    fails. ``fit``, ``fit_like`` and ``shortfall`` are always exact. One lane only.
    """

    optimistic_ok = True
    """``available`` may promise more than ``alloc`` serves (see ``optimistic``)."""

    lanes = 1

    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool
        self.name = "device"

    @property
    def num_pages(self) -> int:
        return self.pool.logical_pages

    @property
    def optimistic(self) -> bool:
        """Whether ``available`` is an upper bound right now rather than exact."""
        return self.pool.compaction != "off" and self.pool.leased

    @property
    def available(self) -> int:
        if self.optimistic:
            return min(self.pool.free_ids, self.pool.free_units // sum(self.pool.sizes))
        return self.pool.fits()

    @property
    def used(self) -> int:
        return self.pool.logical_pages - self.pool.free_ids

    def available_in(self, lane: int) -> int:
        self._lane(lane)
        return self.pool.fits()

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` logical ids (int64 CPU) with all their envelopes, or ``None`` (nothing taken)."""
        return self.pool.take(n)

    def free(self, pages: torch.Tensor) -> None:
        """Free ids and every envelope they still have (``IntegrityError`` for a free, repeated
        or leased page; the batch is validated first)."""
        self.pool.give_back(pages)

    def fit(self, owners: Sequence[int]) -> int:
        for o in owners:
            self._lane(o)
        return min(len(owners), self.pool.fits())

    def fit_like(self, pages: torch.Tensor) -> int:
        return min(pages.numel(), self.pool.fits())

    def shortfall(self, owners: Sequence[int]) -> dict[int, int]:
        for o in owners:
            self._lane(o)
        short = len(owners) - self.pool.fits()
        return {0: short} if short > 0 else {}

    def alloc_owned(self, owners: Sequence[int]) -> torch.Tensor | None:
        for o in owners:
            self._lane(o)
        return self.alloc(len(owners))

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    def _lane(self, lane: int) -> None:
        if lane != 0:
            raise IntegrityError(f"{self.name}: owner {lane} outside 1 lane (unified pool)")


def check_arena(pool: UnifiedPool) -> None:
    """Free + used ids and units add up, envelopes do not overlap, leases are >= 0 and
    only on allocated pages, every allocated page has every non-window envelope."""
    alive = int(pool._alive.sum())
    free = list(pool._free)
    if len(set(free)) != len(free) or alive + len(free) != pool.logical_pages:
        raise IntegrityError(
            f"unified pool: {alive} allocated + {len(free)} free ids != {pool.logical_pages}"
        )
    if free and bool(pool._alive[torch.tensor(free)].any()):
        raise IntegrityError("unified pool: a free id is marked allocated")
    if int(pool._leases.sum()) != pool._lease_total:
        raise IntegrityError("unified pool: the lease total disagrees with the lease counts")
    if bool((pool._leases < 0).any()) or bool((pool._leases[~pool._alive] != 0).any()):
        raise IntegrityError("unified pool: negative lease or lease on a free page")
    live = pool._table[:, pool._alive]
    if live.numel() and bool((live[[not w for w in pool.windowed]] < 0).any()):
        raise IntegrityError("unified pool: an allocated page lacks a non-window envelope")
    if bool((pool._table[:, ~pool._alive] >= 0).any()):
        raise IntegrityError("unified pool: a free page still has an envelope")
    seen = bytearray(pool.units)
    for e in pool._envelopes():
        if e.base < 0 or e.base + e.size > pool.units or any(seen[e.base : e.base + e.size]):
            raise IntegrityError(
                f"unified pool: envelope of page {e.page} ({pool.specs[e.component].name}) "
                f"at unit {e.base} overlaps another or leaves the arena"
            )
        env.take(seen, e.base, e.size)
    if seen != pool._units:
        raise IntegrityError("unified pool: the unit map disagrees with the envelope table")

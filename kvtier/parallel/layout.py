"""Context-parallel page layout: which rank owns which page, and where its bytes live.

Two mappings, both the same on every rank of a CP group:

* **Sequence owners.** Page ``i`` of a sequence (counted from the sequence's first token) is
  computed and held by one rank, chosen by ``pattern``. ``zigzag`` walks the ranks up and back
  down, so the expensive late pages of causal attention are spread evenly over the group (the
  seeds' in-sequence compute-owner pattern); ``round_robin`` simply cycles::

      cp_size = 3, page i   0 1 2 | 3 4 5 | 6 7 8 | 9 10 11
      round_robin owner     0 1 2 | 0 1 2 | 0 1 2 | 0  1  2
      zigzag owner          0 1 2 | 2 1 0 | 0 1 2 | 2  1  0

* **Logical page ids.** The tree, the scheduler and the engine hold logical page ids in one
  space for the whole group; logical page ``L`` lives on lane (rank) ``L % cp_size`` at
  physical page ``L // cp_size`` of that rank's pools. An allocator that keeps a page on its
  sequence owner hands out ids from the owner's lane (``kvtier.pools.allocator.PageAllocator``
  with lanes)::

      cp_size = 3, 4 physical pages per rank → logical ids 0 .. 11
      logical L        0 1 2 3 4 5 6 7 8 9 10 11
      lane (owner)     0 1 2 0 1 2 0 1 2 0  1  2
      physical page    0 0 0 1 1 1 2 2 2 3  3  3

With ``cp_size == 1`` both mappings are the identity: rank 0 owns every page and logical ids are
physical ids, which is what the cache does without context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.config import CP_PATTERNS
from kvtier.errors import ConfigError, IntegrityError

PATTERNS = CP_PATTERNS
"""``CPLayout.pattern`` choices."""


@dataclass(frozen=True)
class CPLayout:
    """The CP group's page ownership as seen from one rank. Validated at construction."""

    cp_size: int = 1
    """Ranks in the context-parallel group (1: no context parallelism)."""
    rank: int = 0
    """This rank's index in the group, ``0 <= rank < cp_size``."""
    pattern: str = "round_robin"
    """Owner of page ``i`` of a sequence: ``round_robin`` (``i % cp_size``) or ``zigzag``
    (ranks ``0 .. cp_size-1`` then ``cp_size-1 .. 0``, repeating every ``2 * cp_size`` pages)."""

    def __post_init__(self) -> None:
        if isinstance(self.cp_size, bool) or not isinstance(self.cp_size, int) or self.cp_size < 1:
            raise ConfigError(f"CPLayout cp_size must be a positive integer, got {self.cp_size!r}")
        if (
            isinstance(self.rank, bool)
            or not isinstance(self.rank, int)
            or not 0 <= self.rank < self.cp_size
        ):
            raise ConfigError(
                f"CPLayout rank must be an integer in [0, cp_size={self.cp_size}), "
                f"got {self.rank!r}"
            )
        if self.pattern not in PATTERNS:
            raise ConfigError(
                f"CPLayout pattern={self.pattern!r} is not one of {', '.join(PATTERNS)}"
            )

    # -- sequence owners ---------------------------------------------------------------------

    def owner(self, page: int) -> int:
        """Rank that owns page ``page`` of a sequence (``page >= 0``)."""
        if page < 0:
            raise IntegrityError(f"rank {self.rank}: owner of negative sequence page {page}")
        n = self.cp_size
        if self.pattern == "round_robin":
            return page % n
        j = page % (2 * n)
        return j if j < n else 2 * n - 1 - j

    def owners(self, start: int, stop: int) -> list[int]:
        """Owner of each sequence page in ``[start, stop)``, in order."""
        self._check_range(start, stop)
        return [self.owner(i) for i in range(start, stop)]

    def owned(self, start: int, stop: int, rank: int | None = None) -> list[int]:
        """Sequence pages in ``[start, stop)`` that ``rank`` (this rank by default) owns."""
        r = self._rank(rank)
        return [start + k for k, o in enumerate(self.owners(start, stop)) if o == r]

    def rank_pages(self, num_pages: int, rank: int | None = None) -> int:
        """Physical pages ``rank`` holds for a sequence of ``num_pages`` logical pages."""
        return len(self.owned(0, num_pages, rank))

    def pool_pages(self, num_pages: int) -> int:
        """Physical pages every rank's pool needs so that ``num_pages`` logical pages fit: the
        largest per-rank share, the same number on every rank. Both patterns are balanced, so
        this is ``ceil(num_pages / cp_size)`` for a sequence and for a logical pool alike."""
        if num_pages < 0:
            raise ConfigError(f"CPLayout.pool_pages: num_pages must be >= 0, got {num_pages}")
        return -(-num_pages // self.cp_size)

    # -- logical page ids (lanes) -------------------------------------------------------------

    def logical_pages(self, physical_pages: int) -> int:
        """Size of the group's logical page space when every rank's pool has
        ``physical_pages`` pages."""
        return physical_pages * self.cp_size

    def lane(self, logical_page: int) -> int:
        """Rank whose pools hold logical page ``logical_page``."""
        return logical_page % self.cp_size

    def lanes(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """``lane`` of each logical page id (int64, same shape)."""
        return logical_pages.to(torch.int64) % self.cp_size

    def owned_mask(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """True where a logical page id lives on this rank."""
        return self.lanes(logical_pages) == self.rank

    def physical(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Physical page ids on this rank of logical ``logical_pages``; every one of them must
        live here (filter with :meth:`owned_mask` first) or ``IntegrityError`` names it."""
        pages = logical_pages.reshape(-1).cpu().to(torch.int64)
        bad = self.lanes(pages) != self.rank
        if bool(bad.any()):
            p = int(pages[bad][0])
            raise IntegrityError(
                f"rank {self.rank}: logical page {p} lives on rank {self.lane(p)}, "
                f"not here (cp_size={self.cp_size}); filter owned pages before translating"
            )
        return pages // self.cp_size

    def logical(self, physical_pages: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Logical ids of ``rank``'s physical pages (the inverse of :meth:`physical`)."""
        return physical_pages.to(torch.int64) * self.cp_size + self._rank(rank)

    def translator(self, device_pages: int, host_pages: int) -> CPTranslator:
        """The transfer-boundary translator for this rank's pools of these sizes."""
        return CPTranslator(self, device_pages, host_pages)

    # -- helpers ------------------------------------------------------------------------------

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            return self.rank
        if not 0 <= rank < self.cp_size:
            raise IntegrityError(f"rank {self.rank}: no rank {rank} in a group of {self.cp_size}")
        return rank

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop:
            raise IntegrityError(f"rank {self.rank}: bad sequence page range [{start}, {stop})")


class CPTranslator:
    """Logical → physical pages for one rank's pools (a ``PageTranslator``).

    Both pools use lanes: the group's allocators hand out logical ids, and this rank's device
    and host pools back the ids of its own lane, ``logical = physical * cp_size + rank``. A
    node's pages keep one owner through every tier (a host copy sits on the lane of the device
    copy it came from, a load on the lane of the host copy), so a rank only ever moves its own
    shard. Translating a page of another lane is a bug upstream (the owned pages were not
    filtered) and raises ``IntegrityError`` naming the rank.

        logical ids this rank translates    rank, rank + cp, ..., rank + (P-1) * cp
        physical pages                      0 .. P-1      (P = device_pages or host_pages)
    """

    __slots__ = ("layout", "device_pages", "host_pages")

    def __init__(self, layout: CPLayout, device_pages: int, host_pages: int) -> None:
        for option, value in (("device_pages", device_pages), ("host_pages", host_pages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"CPTranslator {option} must be an integer >= 0, got {value!r}")
        self.layout = layout
        self.device_pages = device_pages
        self.host_pages = host_pages

    def device_physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self._physical(pages, self.device_pages, "device")

    def device_owned(self, pages: torch.Tensor) -> torch.Tensor | None:
        return self.layout.owned_mask(pages.reshape(-1).cpu()).reshape(pages.shape)

    def host_physical(self, pages: torch.Tensor) -> torch.Tensor:
        return self._physical(pages, self.host_pages, "host")

    def _physical(self, pages: torch.Tensor, limit: int, side: str) -> torch.Tensor:
        phys = self.layout.physical(pages)
        if phys.numel() and int(phys.max()) >= limit:
            p = int(pages.reshape(-1).cpu()[phys >= limit][0])
            raise IntegrityError(
                f"rank {self.layout.rank}: logical {side} page {p} is beyond this rank's "
                f"{limit} {side} pages"
            )
        return phys

    def check(self, device_pages: int, host_pages: int) -> None:
        if (device_pages, host_pages) != (self.device_pages, self.host_pages):
            raise ConfigError(
                f"CPTranslator for rank {self.layout.rank} was built for device_pages="
                f"{self.device_pages}, host_pages={self.host_pages}, but the pools have "
                f"device_pages={device_pages}, host_pages={host_pages}"
            )

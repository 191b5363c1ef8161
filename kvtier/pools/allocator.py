"""Free-list page allocator. The only owner of which pages of a pool are free."""

from __future__ import annotations

from collections import deque

import torch

from kvtier.errors import CapacityError, IntegrityError, RequestError


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``.

    Order is deterministic: ``alloc`` takes from the front of the free list, ``free`` appends to
    the back (so a freed page is reused only after every page freed before it).
    """

    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages <= 0:
            raise CapacityError(f"{name}: num_pages must be positive, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` page ids as an int64 CPU tensor, or ``None`` when fewer than ``n`` are free;
        a negative ``n`` raises ``RequestError``."""
        if n < 0:
            raise RequestError(f"{self.name}: cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return torch.tensor(pages, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages; freeing a free or out-of-range page is an ``IntegrityError``.

        The whole batch is validated first, so a rejected call changes nothing.
        """
        ids = pages.reshape(-1).tolist()
        seen: set[int] = set()
        for p in ids:
            if not 0 <= p < self.num_pages:
                raise IntegrityError(f"{self.name}: free of out-of-range page {p}")
            if self._is_free[p] or p in seen:
                raise IntegrityError(f"{self.name}: double free of page {p}")
            seen.add(p)
        for p in ids:
            self._is_free[p] = 1
        self._free.extend(ids)

    def check_integrity(self) -> None:
        """free + used == capacity, and the free list has no duplicates."""
        if len(set(self._free)) != len(self._free):
            raise IntegrityError(f"{self.name}: duplicate pages in the free list")
        if sum(self._is_free) != len(self._free):
            raise IntegrityError(f"{self.name}: free flags disagree with the free list")
        if any(not self._is_free[p] for p in self._free):
            raise IntegrityError(f"{self.name}: a listed free page is marked used")

"""Free-list page allocator. The only owner of which pages of a pool are free."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvtier.errors import CapacityError, IntegrityError, RequestError


class PageAllocator:
    """Hands out page ids ``0 .. num_pages-1``.

    Order is deterministic: ``alloc`` takes from the front of a free list, ``free`` appends to
    the back (so a freed page is reused only after every page freed before it).

    With ``lanes > 1`` (a context-parallel rank's view of its group's pages) page ``p`` belongs
    to lane ``p % lanes``, the rank whose pools hold its bytes, and each lane has a free list of
    its own. Every allocation then says which lane each page must come from (``alloc_owned``):
    a page handed out on the wrong lane would have one rank write bytes that another rank's
    attention reads, so a plain ``alloc`` is refused. Every rank runs the same allocator on the
    same calls, so the ids agree everywhere::

        lanes = 2, num_pages = 8     lane 0: 0 2 4 6     lane 1: 1 3 5 7
        alloc_owned([0, 1, 1, 0])    → 0 1 3 2

    With ``ready`` (a host pool pinned in the background, ``kvtier.pools.pinning``) only pages
    ``0 .. ready()-1`` may be handed out: the rest are *pending*, neither free nor used, and
    join the back of the free list (in id order) when ``ready()`` has grown past them, at the
    next allocation or :meth:`poll`. ``ready`` is read here, on the allocating thread, and
    never decreases; the thread that advances it never touches the allocator.
    ``num_pages`` stays the configured capacity: free + used + pending == num_pages.
    """

    def __init__(
        self,
        num_pages: int,
        name: str = "pool",
        lanes: int = 1,
        ready: Callable[[], int] | None = None,
    ) -> None:
        if num_pages <= 0:
            raise CapacityError(f"{name}: num_pages must be positive, got {num_pages}")
        if lanes < 1 or num_pages % lanes:
            raise CapacityError(f"{name}: {num_pages} pages do not split into {lanes} lanes")
        self.name = name
        self.num_pages = num_pages
        self.lanes = lanes
        self._ready_fn = ready
        self._ready = 0
        """Pages folded into the free lists (``0 .. _ready-1``)."""
        self._lists: list[deque[int]] = [deque() for _ in range(lanes)]
        self._free = self._lists[0]  # the only list without lanes: the fast path
        self._count = 0
        # 1 free, 0 used, 2 pending
        self._is_free = bytearray(b"\x02") * num_pages
        if ready is None:
            self._fold(num_pages)
        self.poll()

    def poll(self) -> None:
        """Move pages that became ready onto the free lists."""
        if self._ready_fn is not None:
            self._fold(min(self._ready_fn(), self.num_pages))

    def _fold(self, ready: int) -> None:
        lo = self._ready
        if ready <= lo:
            return
        self._is_free[lo:ready] = b"\x01" * (ready - lo)
        if self.lanes == 1:
            self._free.extend(range(lo, ready))
        else:
            for p in range(lo, ready):
                self._lists[p % self.lanes].append(p)
        self._count += ready - lo
        self._ready = ready
        if ready == self.num_pages:
            self._ready_fn = None

    @property
    def pending(self) -> int:
        """Pages not ready yet (neither free nor used)."""
        self.poll()
        return self.num_pages - self._ready

    @property
    def available(self) -> int:
        self.poll()
        return self._count

    @property
    def used(self) -> int:
        return self._ready - self._count

    def available_in(self, lane: int) -> int:
        """Free pages of ``lane``."""
        self.poll()
        return len(self._lists[lane])

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` page ids as an int64 CPU tensor, or ``None`` when fewer than ``n`` are free;
        a negative ``n`` raises ``RequestError``. Refused with lanes (use ``alloc_owned``)."""
        if n < 0:
            raise RequestError(f"{self.name}: cannot allocate {n} pages")
        if self.lanes > 1:
            raise IntegrityError(
                f"{self.name}: a plain allocation of {n} pages ignores which rank owns each "
                f"page ({self.lanes} lanes); allocate with the pages' owners"
            )
        self.poll()
        if n > self._count:
            return None
        pages = [self._free.popleft() for _ in range(n)]
        self._count -= n
        for p in pages:
            self._is_free[p] = 0
        return torch.tensor(pages, dtype=torch.int64)

    def shortfall(self, owners: Sequence[int]) -> dict[int, int]:
        """Pages missing per lane for ``alloc_owned(owners)`` (empty when it would succeed)."""
        self.poll()
        need: dict[int, int] = {}
        for o in owners:
            need[o] = need.get(o, 0) + 1
        out = {}
        for lane, k in sorted(need.items()):
            if not 0 <= lane < self.lanes:
                raise IntegrityError(f"{self.name}: owner {lane} outside {self.lanes} lanes")
            if k > len(self._lists[lane]):
                out[lane] = k - len(self._lists[lane])
        return out

    def fit(self, owners: Sequence[int]) -> int:
        """How many leading entries of ``owners`` ``alloc_owned`` could serve now."""
        self.poll()
        left = [len(q) for q in self._lists]
        for i, o in enumerate(owners):
            if left[o] == 0:
                return i
            left[o] -= 1
        return len(owners)

    def fit_like(self, pages: torch.Tensor) -> int:
        """``fit`` of the lanes of ``pages`` (a copy of them in this pool)."""
        if self.lanes == 1:
            return min(pages.numel(), self.available)
        return self.fit((pages.reshape(-1).cpu() % self.lanes).tolist())

    def alloc_owned(self, owners: Sequence[int]) -> torch.Tensor | None:
        """One page per entry, page ``i`` from lane ``owners[i]``; ``None`` (nothing taken)
        when a lane is short."""
        if self.shortfall(owners):
            return None
        pages = [self._lists[o].popleft() for o in owners]
        self._count -= len(pages)
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
            if self._is_free[p] == 2:
                raise IntegrityError(f"{self.name}: free of page {p}, which is not ready yet")
            if self._is_free[p] or p in seen:
                raise IntegrityError(f"{self.name}: double free of page {p}")
            seen.add(p)
        for p in ids:
            self._is_free[p] = 1
        if self.lanes == 1:
            self._free.extend(ids)
        else:
            for p in ids:
                self._lists[p % self.lanes].append(p)
        self._count += len(ids)

    def check_integrity(self) -> None:
        """free + used + pending == capacity, exactly the pages past the ready ones are
        pending, every free list holds only its lane's pages, no duplicates."""
        listed = [p for q in self._lists for p in q]
        if len(set(listed)) != len(listed):
            raise IntegrityError(f"{self.name}: duplicate pages in the free list")
        pending = self.num_pages - self._ready
        if (
            self._is_free[self._ready :] != b"\x02" * pending
            or b"\x02" in self._is_free[: self._ready]
        ):
            raise IntegrityError(f"{self.name}: pending flags disagree with {self._ready} ready")
        if len(listed) != self._count or self._is_free.count(1) != self._count:
            raise IntegrityError(f"{self.name}: free flags disagree with the free list")
        if self._count + self.used + pending != self.num_pages or self.used < 0:
            raise IntegrityError(f"{self.name}: free + used + pending != {self.num_pages}")
        if any(self._is_free[p] != 1 for p in listed):
            raise IntegrityError(f"{self.name}: a listed free page is marked used")
        for lane, q in enumerate(self._lists):
            if any(p % self.lanes != lane for p in q):
                raise IntegrityError(f"{self.name}: lane {lane}'s free list holds another lane")

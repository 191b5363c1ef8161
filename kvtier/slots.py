"""The engine's device pages: allocation, hand-over to the tree, freeing, and the checks on
every slot list the engine hands back.

A device page is free (allocator), cached (tree) or engine-owned: allocated by ``alloc`` and
not yet given to the tree by ``insert`` nor returned by ``free``. ``EnginePages`` is the one
record of the third state. Every slot list handed in is checked against it before any state
changes, so a double ``finish``, a ``free`` of a cached page, a wrong ``prefix_len``, a
misaligned page or a slot outside the pool is refused instead of corrupting the pools.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import CapacityError, IntegrityError, RequestError
from kvtier.paging import align_down, pages_to_locs

if TYPE_CHECKING:
    from kvtier.pools.device import DevicePool
    from kvtier.results import Handle
    from kvtier.tree.node import Node
    from kvtier.tree.radix import RadixTree

AllocFn = Callable[[int, int], "torch.Tensor | None"]
"""``(first_page, n)``: device pages for sequence pages ``[first_page, first_page + n)``,
evicting cached ones if needed; ``None`` if impossible."""
InsertedFn = Callable[[list["Node"]], None]
"""Told which nodes took engine pages (the write policy backs them up)."""


class EnginePages:
    """Ownership flags of the device pool's pages (CPU, one bool per page) and the calls that
    move pages in and out of the engine's hands."""

    def __init__(
        self,
        pool: DevicePool,
        tree: RadixTree,
        alloc: AllocFn,
        on_insert: InsertedFn,
        stateful: bool,
        on_free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        """``on_free(pages)`` is told of engine pages going back to the allocator."""
        self.pool = pool
        self.tree = tree
        self.page_size = tree.page_size
        self._alloc = alloc
        self._on_insert = on_insert
        self.stateful = stateful
        self._on_free = on_free
        self._owned = torch.zeros(pool.logical_pages, dtype=torch.bool)

    @property
    def count(self) -> int:
        """Pages the engine owns now."""
        return int(self._owned.sum())

    # ---- the lifecycle ------------------------------------------------------------------
    def alloc(self, num_tokens: int, at: int | None = None) -> torch.Tensor:
        """Slots of ``ceil(num_tokens / page_size)`` fresh whole pages for the tokens from
        sequence position ``at`` on (a multiple of ``page_size``; required when the pool is
        one rank's shard of a CP group, where each page goes to its owner)."""
        n = -(-num_tokens // self.page_size)
        if at is None:
            if self.pool.allocator.lanes > 1:
                raise RequestError(
                    "alloc: under context parallelism (cp_size="
                    f"{self.pool.allocator.lanes}) pass at=, the sequence position of the "
                    "first token, so that each page goes to the rank that owns it"
                )
            at = 0
        if isinstance(at, bool) or not isinstance(at, int) or at < 0 or at % self.page_size:
            raise RequestError(
                f"alloc: at={at!r} must be a sequence position >= 0 on a page boundary "
                f"(page_size={self.page_size})"
            )
        pages = self._alloc(at // self.page_size, n)
        if pages is None:
            raise CapacityError(
                f"device pool: {n} pages requested, {self.pool.allocator.available} free of "
                f"{self.pool.logical_pages} after evicting every unlocked cached page"
            )
        self._owned[pages.cpu()] = True
        return pages_to_locs(pages, self.page_size)

    def free(self, locs: torch.Tensor) -> None:
        """Free the pages containing ``locs``, which must all be the engine's."""
        pages = torch.unique(self._pages_of(locs, "free"))
        self._require_owned(pages, "free")
        self._free(pages)

    def insert(
        self,
        tokens: Sequence[int],
        locs: torch.Tensor,
        checkpoints: torch.Tensor | None,
        what: str = "insert",
    ) -> int:
        """Give the tree the whole pages of ``tokens`` at ``locs``; returns ``cached_len``."""
        n = align_down(min(len(tokens), locs.numel()), self.page_size)
        pages = self._whole_pages(locs[:n], what)
        self._check_insert(tokens[:n], pages, what)
        return self._insert(tokens[:n], pages, checkpoints)

    def finish(
        self,
        tokens: Sequence[int],
        locs: torch.Tensor,
        prefix_len: int,
        handle: Handle | None,
        checkpoints: torch.Tensor | None,
    ) -> int:
        """Insert, then free every engine page of ``locs`` the tree did not take (duplicates
        and the partial tail). All checks run first. Returns the tokens inserted."""
        all_pages = self._check_finish(locs, prefix_len, handle)
        n = align_down(min(len(tokens), locs.numel()), self.page_size)
        pages = self._whole_pages(locs[:n], "finish")
        self._check_insert(tokens[:n], pages, "finish")
        self._insert(tokens[:n], pages, checkpoints)
        rest = torch.unique(all_pages)
        rest = rest[self._owned[rest]]
        if rest.numel():
            self._free(rest)
        return n

    def _insert(
        self, tokens: Sequence[int], pages: torch.Tensor, checkpoints: torch.Tensor | None
    ) -> int:
        flags = None
        if self.stateful:
            k = pages.numel()
            flags = torch.zeros(k, dtype=torch.bool)
            if checkpoints is not None:
                flags[: min(k, checkpoints.numel())] = checkpoints[:k].to(torch.bool).cpu()
        out = self.tree.insert(tokens, pages, tier="device", checkpoints=flags)
        # Duplicates only ever precede cached_len (a device copy's parent has one too).
        self._owned[pages[out.cached_len // self.page_size :]] = False
        self._on_insert(out.taken)
        return out.cached_len

    def _free(self, pages: torch.Tensor) -> None:
        if self._on_free is not None:
            self._on_free(pages)
        self._owned[pages] = False
        self.pool.free_pages(pages)

    # ---- checks -------------------------------------------------------------------------
    def owned_pages(self, locs: torch.Tensor) -> torch.Tensor:
        """The distinct pages of ``locs`` that are the engine's (CPU int64, ascending)."""
        pages = torch.unique(self._pages_of(locs, "owned_pages"))
        return pages[self._owned[pages]]

    def _pages_of(self, locs: torch.Tensor, what: str) -> torch.Tensor:
        """Page of every slot in ``locs`` (CPU int64), after checking the slots lie in the pool.

        Raises ``RequestError`` naming the first slot outside ``[0, logical_pages * page_size)``.
        """
        locs = locs.reshape(-1).cpu()
        if locs.dtype.is_floating_point or locs.dtype == torch.bool:
            raise RequestError(f"{what}: slots must be an integer tensor, got {locs.dtype}")
        locs = locs.to(torch.int64)
        limit = self.pool.logical_pages * self.page_size
        bad = (locs < 0) | (locs >= limit)
        if bool(bad.any()):
            slot = int(locs[bad][0])
            raise RequestError(f"{what}: slot {slot} lies outside the device pool [0, {limit})")
        return locs // self.page_size

    def _whole_pages(self, locs: torch.Tensor, what: str) -> torch.Tensor:
        """Page ids of ``locs``, whole pages of consecutive, aligned slots (checked: the tree
        records a page by its id, so a rotated or gapped page would map tokens to wrong
        slots)."""
        pages = self._pages_of(locs, what)
        ps = self.page_size
        if ps == 1 or pages.numel() == 0:
            return pages
        rows = locs.reshape(-1, ps).cpu().to(torch.int64)
        bad = (rows != rows[:, :1] + torch.arange(ps)).any(1) | (rows[:, 0] % ps != 0)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise RequestError(
                f"{what}: page {i} of the slots ({rows[i].tolist()}) is not {ps} consecutive "
                f"slots starting at a multiple of page_size={ps}"
            )
        return rows[:, 0] // ps

    def _require_owned(self, pages: torch.Tensor, what: str) -> None:
        mine = self._owned[pages]
        if not bool(mine.all()):
            bad = torch.unique(pages[~mine]).tolist()[:8]
            raise RequestError(
                f"{what}: device page(s) {bad} are not the engine's (already cached, freed or "
                "never allocated)"
            )

    def _check_insert(self, tokens: Sequence[int], pages: torch.Tensor, what: str) -> None:
        """Refuse pages the tree would take that are not the engine's. Where the tree already
        caches a page on device the caller may pass that very page (it came from ``load``) or
        a page of its own (a duplicate it frees); everywhere else only its own pages."""
        if torch.unique(pages).numel() != pages.numel():
            raise RequestError(f"{what}: a device page appears twice in the slots")
        m = self.tree.match(tokens)
        held = [n.device for n in m.path if n.device is not None]
        have = torch.cat(held)[: m.device_len // self.page_size] if held else pages[:0]
        ok = self._owned[pages]
        k = have.numel()
        ok[:k] |= pages[:k] == have
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise RequestError(
                f"{what}: device page {int(pages[i])} (tokens from {i * self.page_size}) is "
                "neither the engine's nor the page the cache holds there"
            )

    def _check_finish(
        self, locs: torch.Tensor, prefix_len: int, handle: Handle | None
    ) -> torch.Tensor:
        """``handle`` still locked, ``prefix_len`` the length ``load`` returned for it (0
        without a handle), ``locs`` starting with those slots and the engine's after them.
        Returns the page of every slot in ``locs``."""
        loaded = None
        if handle is not None:
            if handle.node is None:
                raise RequestError("finish: the handle is not locked (finished twice?)")
            loaded = handle.load_result.locs if handle.load_result is not None else None
        expect = 0 if loaded is None else loaded.numel()
        if prefix_len != expect:
            raise RequestError(
                f"finish: prefix_len={prefix_len} but load() returned {expect} cached slots"
            )
        if prefix_len > locs.numel() or (
            loaded is not None and not torch.equal(locs[:prefix_len].cpu(), loaded.cpu())
        ):
            raise RequestError("finish: locs do not start with the slots load() returned")
        pages = self._pages_of(locs, "finish")
        self._require_owned(torch.unique(pages[prefix_len:]), "finish")
        return pages

    def check_integrity(self) -> None:
        """Cached pages are never also engine-owned; every owned page is allocated."""
        held = self.tree.held_pages("device")
        if held.numel() and bool(self._owned[held].any()):
            bad = held[self._owned[held]].tolist()[:8]
            raise IntegrityError(f"device page(s) {bad} both cached and engine-owned")
        if self.count + held.numel() != self.pool.allocator.used:
            raise IntegrityError(
                f"device pages: {self.pool.allocator.used} used != {held.numel()} cached + "
                f"{self.count} engine-owned"
            )

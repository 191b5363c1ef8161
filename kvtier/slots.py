"""Which device pages the engine owns, and the checks on slots it hands back to the cache.

A device page is free (allocator), cached (tree) or engine-owned: allocated by ``alloc`` and
not yet given to the tree by ``insert`` nor returned by ``free``. The ledger below is the one
record of the third state; every slot list the engine hands in is checked against it before
any state changes, so a double ``finish``, a ``free`` of a cached page or a slot outside the
pool is refused instead of corrupting the pools.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import IntegrityError, RequestError

if TYPE_CHECKING:
    from kvtier.results import Handle
    from kvtier.tree.radix import RadixTree


class EnginePages:
    """Ownership flags of the ``num_pages`` device pages (CPU, one bool per page)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._owned = torch.zeros(num_pages, dtype=torch.bool)

    @property
    def count(self) -> int:
        """Pages the engine owns now."""
        return int(self._owned.sum())

    def take(self, pages: torch.Tensor) -> None:
        """``pages`` were just allocated for the engine."""
        self._owned[pages.cpu()] = True

    def release(self, pages: torch.Tensor) -> None:
        """``pages`` left the engine (given to the tree, or freed)."""
        self._owned[pages.cpu()] = False

    def owned(self, pages: torch.Tensor) -> torch.Tensor:
        """Per page of ``pages``: whether the engine owns it."""
        return self._owned[pages.cpu()]

    def pages_of(self, locs: torch.Tensor, what: str) -> torch.Tensor:
        """Page of every slot in ``locs`` (CPU int64), after checking the slots lie in the pool.

        Raises ``RequestError`` naming the first slot outside ``[0, num_pages * page_size)``.
        """
        locs = locs.reshape(-1).cpu()
        if locs.dtype.is_floating_point or locs.dtype == torch.bool:
            raise RequestError(f"{what}: slots must be an integer tensor, got {locs.dtype}")
        locs = locs.to(torch.int64)
        limit = self.num_pages * self.page_size
        bad = (locs < 0) | (locs >= limit)
        if bool(bad.any()):
            slot = int(locs[bad][0])
            raise RequestError(f"{what}: slot {slot} lies outside the device pool [0, {limit})")
        return locs // self.page_size

    def require_owned(self, pages: torch.Tensor, what: str) -> None:
        """Raise ``RequestError`` naming the pages of ``pages`` the engine does not own."""
        mine = self.owned(pages)
        if not bool(mine.all()):
            bad = torch.unique(pages[~mine]).tolist()[:8]
            raise RequestError(
                f"{what}: device page(s) {bad} are not the engine's (already cached, freed or "
                "never allocated)"
            )

    def check_insert(
        self, tree: RadixTree, tokens: Sequence[int], pages: torch.Tensor, what: str
    ) -> None:
        """Refuse pages the tree would take that are not the engine's. Where the tree already
        caches a page on device the caller may pass that very page (it came from ``load``) or
        a page of its own (a duplicate it frees); everywhere else only its own pages."""
        if torch.unique(pages).numel() != pages.numel():
            raise RequestError(f"{what}: a device page appears twice in the slots")
        m = tree.match(tokens)
        held = [n.device for n in m.path if n.device is not None]
        have = torch.cat(held)[: m.device_len // self.page_size] if held else pages[:0]
        ok = self.owned(pages)
        k = have.numel()
        ok[:k] |= pages[:k] == have
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0])
            raise RequestError(
                f"{what}: device page {int(pages[i])} (tokens from {i * self.page_size}) is "
                "neither the engine's nor the page the cache holds there"
            )

    def check_finish(
        self, locs: torch.Tensor, prefix_len: int, handle: Handle | None
    ) -> torch.Tensor:
        """Check ``finish``'s arguments: ``handle`` still locked, ``prefix_len`` the length
        ``load`` returned for it (0 without a handle), ``locs`` starting with those slots and
        owned by the engine after them. Returns the page of every slot in ``locs``."""
        loaded = None
        if handle is not None:
            if handle.node is None:
                raise RequestError("finish: the handle is not locked (finished twice?)")
            loaded = handle.loaded
        expect = 0 if loaded is None else loaded.numel()
        if prefix_len != expect:
            raise RequestError(
                f"finish: prefix_len={prefix_len} but load() returned {expect} cached slots"
            )
        if prefix_len > locs.numel() or (
            loaded is not None and not torch.equal(locs[:prefix_len].cpu(), loaded.cpu())
        ):
            raise RequestError("finish: locs do not start with the slots load() returned")
        pages = self.pages_of(locs, "finish")
        self.require_owned(torch.unique(pages[prefix_len:]), "finish")
        return pages

    def check_disjoint(self, held: torch.Tensor) -> None:
        """Cached pages are never also engine-owned."""
        if held.numel() and bool(self._owned[held].any()):
            bad = held[self._owned[held]].tolist()[:8]
            raise IntegrityError(f"device page(s) {bad} both cached and engine-owned")

"""The engine's device pages: allocation, hand-over to the tree, freeing, and the checks on
every slot list the engine hands back.

A device page is free (allocator), cached (tree) or engine-owned: allocated by ``alloc`` and
not yet given to the tree by ``insert`` nor returned by ``free``. ``EnginePages`` is the one
record of the third state. Every slot list handed in is checked against it before any state
changes, so a double ``finish``, a ``free`` of a cached page, a wrong ``prefix_len``, a
misaligned page or a slot outside the pool is refused instead of corrupting the pools.

Partial tails (``tails``: ``CacheConfig.cache_partial_pages``, no state or window pool).
``finish`` caches the valid tail of the last, partial page too. A cached tail is
shared and never written: ``load`` serving a prefix that ends in one hands the request a
*tail copy* instead, a fresh engine page holding a copy of the tail page (``tail_copy``), and
the next ``alloc`` at the unaligned position continues it. A finished request's pages
(``ps`` = page size, ``n`` = valid tokens, ``r = n % ps``)::

    pages of locs               tails on                          tails off
    [0, n // ps)                whole pages: inserted             same
    page n // ps (r > 0)        inserted as a partial tail        freed
    the tail copy of a load     extends the cached tail: the      same as the pages
                                tree replaces the tail (freed)    around it
                                or, when that tail is locked or
                                busy, the copy is freed
    duplicates, refused pages   freed                             freed
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.cache import slot_checks
from kvtier.cache.windows import give_back_windows, hand_over_windows
from kvtier.errors import CapacityError, IntegrityError, RequestError
from kvtier.paging import align_down, pages_to_locs

if TYPE_CHECKING:
    from kvtier.cache.results import Handle
    from kvtier.pools.device import DevicePool
    from kvtier.tree.node import Node
    from kvtier.tree.radix import RadixTree
    from kvtier.tree.results import Evicted

AllocFn = Callable[[int, int], "torch.Tensor | None"]
"""``(first_page, n)``: device pages for sequence pages ``[first_page, first_page + n)``,
evicting cached ones if needed; ``None`` if impossible."""
InsertedFn = Callable[[list["Node"]], None]
"""Told which nodes took engine pages (the write policy backs them up)."""
ReleaseFn = Callable[["Evicted"], None]
"""Frees the device and host pages of partial tails the tree dropped."""
CopyFn = Callable[[int, int], None]
"""``(src, dst)``: copy every component's rows of device page ``src`` to page ``dst``."""


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
        tails: bool = False,
        release: ReleaseFn | None = None,
        copy_page: CopyFn | None = None,
        on_windows: InsertedFn | None = None,
    ) -> None:
        """``on_free(pages)`` is told of engine pages going back to the allocator. ``tails``:
        cache partial tails (then ``release`` and ``copy_page`` are needed). ``stateful``:
        the pool set has a partial component (a state or window pool), so every inserted
        page carries a ``Node.ckpt`` flag. ``on_windows(nodes)`` (window pools) is told of
        cached nodes whose device pages took window rows from the engine's duplicates."""
        self.pool = pool
        self.tree = tree
        self.page_size = tree.page_size
        self._alloc = alloc
        self._on_insert = on_insert
        self.stateful = stateful
        self._on_free = on_free
        self.tails = tails and release is not None and copy_page is not None
        self._release = release
        self._copy_page = copy_page
        self._owned = torch.zeros(pool.logical_pages, dtype=torch.bool)
        self._owned_np = self._owned.numpy()
        """The same flags as a numpy view: the checks run on every ``finish``, and a numpy
        operation on a few hundred slots costs a fraction of a torch one's dispatch."""
        self.windowed = any(s.kind == "window" for s in pool.specs)
        self._on_windows = on_windows
        """A window pool (``UnifiedPool``): a page's flag is whether it has window rows."""
        self._pending: list[tuple[int, int]] = []
        """``(at, page)``: tail copies handed out by ``load`` that no ``alloc`` continued yet
        (``at`` = the sequence position after the copied valid tokens)."""

    @property
    def count(self) -> int:
        """Pages the engine owns now."""
        return int(self._owned.sum())

    # ---- the lifecycle ------------------------------------------------------------------
    def alloc(self, num_tokens: int, at: int | None = None) -> torch.Tensor:
        """Slots of ``ceil(num_tokens / page_size)`` fresh whole pages for the tokens from
        sequence position ``at`` on (a multiple of ``page_size``; required when the pool is
        one rank's shard of a CP group, where each page goes to its owner).

        An ``at`` inside a page continues the tail copy a ``load`` just handed out for that
        position: its remaining slots come first (all of them, to the page's end), then fresh
        pages for the rest. Without ``at`` the newest such copy is continued (the usual
        ``load`` then ``alloc`` of one request; interleaved admissions pass ``at``)."""
        ps = self.page_size
        if at is None and self._pending:
            at = self._pending[-1][0]
        if self.tails and isinstance(at, int) and at % ps and not isinstance(at, bool):
            copy = next((p for a, p in reversed(self._pending) if a == at), None)
            if copy is not None:
                room = ps - at % ps
                rest = self.alloc(num_tokens - room, at + room) if num_tokens > room else None
                self._pending.remove((at, copy))
                head = torch.arange(copy * ps + at % ps, (copy + 1) * ps, dtype=torch.int64)
                return head if rest is None else torch.cat((head, rest))
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
        self._owned_np[pages.cpu().numpy()] = True
        return pages_to_locs(pages, self.page_size)

    def free(self, locs: torch.Tensor) -> None:
        """Free the pages containing ``locs``, which must all be the engine's."""
        pages = slot_checks.distinct_pages(self._slots(locs, "free"), self.page_size)
        self._require_owned(pages, "free")
        self._free(torch.from_numpy(pages))

    def tail_copy(self, src: int, at: int) -> int | None:
        """A fresh engine page (for the sequence page holding position ``at``) holding a copy
        of device page ``src``, a cached partial tail whose valid tokens end at ``at``; the
        next ``alloc(…, at=at)`` continues it. ``None`` when no page can be had. Under
        context parallelism the page is allocated for that sequence page, so on its owner's
        lane, the lane the tail itself was allocated on: the owner makes the copy."""
        pages = self._alloc(at // self.page_size, 1)
        if pages is None or self._copy_page is None:
            return None
        page = int(pages[0])
        self._copy_page(src, page)
        self._owned[page] = True
        self._pending.append((at, page))
        return page

    def forget_copy(self, page: int, free: bool) -> None:
        """The request a tail copy was made for is done with it: ``free`` it (an admission
        given up before its ``alloc``) unless an ``alloc`` already handed it to the engine."""
        pending = [e for e in self._pending if e[1] == page]
        for e in pending:
            self._pending.remove(e)
        if free and pending and bool(self._owned[page]):
            self._free(torch.tensor([page], dtype=torch.int64))

    def insert(
        self,
        tokens: Sequence[int],
        locs: torch.Tensor,
        checkpoints: torch.Tensor | None,
        what: str = "insert",
    ) -> int:
        """Give the tree the whole pages of ``tokens`` at ``locs``; returns ``cached_len``.
        Engine pages the tree did not take stay the engine's."""
        n = align_down(min(len(tokens), locs.numel()), self.page_size)
        pages = slot_checks.whole_pages(self._slots(locs[:n], what), self.page_size, what)
        self._check_insert(tokens[:n], pages, what)
        return self._insert(tokens[:n], torch.from_numpy(pages), checkpoints)

    def finish(
        self,
        tokens: Sequence[int],
        locs: torch.Tensor,
        prefix_len: int,
        handle: Handle | None,
        checkpoints: torch.Tensor | None,
        unlock: Callable[[], None] | None = None,
    ) -> int:
        """Insert, then free every engine page of ``locs`` the tree did not take (duplicates,
        refused pages, and the partial tail when tails are off). All checks run first, then
        ``unlock`` (the request's own lock must not keep the tail it extends from being
        replaced). Returns the tokens inserted."""
        slots = self._check_finish(locs, prefix_len, handle)
        n = min(len(tokens), slots.size)
        if not self.tails:
            n = align_down(n, self.page_size)
        pages = slot_checks.pages_with_tail(slots[:n], self.page_size, "finish")
        self._check_insert(tokens[:n], pages, "finish")
        if unlock is not None:
            unlock()
        self._insert(tokens[:n], torch.from_numpy(pages), checkpoints)
        # ``pages`` are the pages of ``slots[:n]`` (checked distinct): only the slots past
        # them need dividing, not all of them again.
        rest = np.unique(np.concatenate((pages, slots[n:] // self.page_size)))
        rest = rest[self._owned_np[rest]]
        if rest.size:
            self._free(torch.from_numpy(rest))
        return n

    def _insert(
        self, tokens: Sequence[int], pages: torch.Tensor, checkpoints: torch.Tensor | None
    ) -> int:
        flags = None
        if self.windowed:
            flags = self.pool.has_window(pages)
        elif self.stateful:
            k = pages.numel()
            flags = torch.zeros(k, dtype=torch.bool)
            if checkpoints is not None:
                flags[: min(k, checkpoints.numel())] = checkpoints[:k].to(torch.bool).cpu()
        out = self.tree.insert(tokens, pages, tier="device", checkpoints=flags)
        # Every page is the tree's now except the duplicates, which stay with their owner:
        # the engine's duplicates are those still flagged (the flags change only below).
        dups = out.duplicates.numpy()
        mine = dups[self._owned_np[dups]]
        self._owned_np[pages.numpy()] = False
        self._owned_np[mine] = True
        if self.windowed and dups.size:
            took = hand_over_windows(self.tree, self.pool, self._owned, tokens, pages)
            if took and self._on_windows is not None:
                self._on_windows(took)
        if out.dropped.device_pages or out.dropped.host_pages:
            if self._release is None:
                raise IntegrityError("the tree dropped a partial tail with nobody to free it")
            self._release(out.dropped)
        self._on_insert(out.taken)
        return out.cached_len

    def release_window(self, locs: torch.Tensor) -> int:
        """The engine reads no window rows of the pages of ``locs`` any more: those of its own
        pages go back to the arena now (cached pages keep theirs: a hit may resume there).
        Returns the pages released."""
        if not self.windowed or not locs.numel():
            return 0
        return give_back_windows(self.pool, self._owned_of(locs, "release_window"))

    def _free(self, pages: torch.Tensor) -> None:
        if self._on_free is not None:
            self._on_free(pages)
        self._owned_np[pages.numpy()] = False
        self.pool.free_pages(pages)

    def layer_backup_pages(
        self, runs: Sequence[tuple[Sequence[int], torch.Tensor, int, int]]
    ) -> torch.Tensor | None:
        """The pages a per-layer backup of a forward copies (``TieredCache.backup_layers``):
        per ``(tokens, locs, start, end)`` run, those full after it, the engine's, and past
        the prefix that already has a host copy (or one in flight); ``None`` if none."""
        ps, pages = self.page_size, []
        for tokens, locs, start, end in runs:
            first, last = start // ps, end // ps  # pages [first, last) are full after it
            if last <= first:
                continue
            tm, hosted = self.tree.match(tokens[: last * ps]), 0
            for node in tm.path:
                if not (node.on_host or node.device_io):
                    break
                hosted += node.num_tokens
            first = max(first, min(hosted, tm.matched_len) // ps)
            if last > first:
                pages.append(self.owned_pages(locs[first * ps : last * ps]))
        return torch.cat(pages) if pages else None

    # ---- checks -------------------------------------------------------------------------
    def owned_pages(self, locs: torch.Tensor) -> torch.Tensor:
        """The distinct pages of ``locs`` that are the engine's (CPU int64, ascending)."""
        return self._owned_of(locs, "owned_pages")

    def _owned_of(self, locs: torch.Tensor, what: str) -> torch.Tensor:
        pages = slot_checks.distinct_pages(self._slots(locs, what), self.page_size)
        return torch.from_numpy(pages[self._owned_np[pages]])

    def _slots(self, locs: torch.Tensor, what: str) -> np.ndarray:
        """``locs`` as checked slots: raises ``RequestError`` naming the first slot outside
        ``[0, logical_pages * page_size)``."""
        return slot_checks.checked(locs, self.pool.logical_pages * self.page_size, what)

    def _require_owned(self, pages: np.ndarray, what: str) -> None:
        mine = self._owned_np[pages]
        if not mine.all():
            bad = np.unique(pages[~mine]).tolist()[:8]
            raise RequestError(
                f"{what}: device page(s) {bad} are not the engine's (already cached, freed or "
                "never allocated)"
            )

    def _check_insert(self, tokens: Sequence[int], p: np.ndarray, what: str) -> None:
        """Refuse pages ``p`` the tree would take that are not the engine's. Where the tree
        already caches a page on device the caller may pass that very page (it came from
        ``load``) or a page of its own (a duplicate it frees); everywhere else only its own
        pages."""
        if np.unique(p).size != p.size:
            raise RequestError(f"{what}: a device page appears twice in the slots")
        m = self.tree.match(tokens)
        ok = self._owned_np[p]
        k = min(m.device_len // self.page_size, p.size)
        if k:
            held = [n.device.numpy() for n in m.path if n.device is not None]
            have = np.concatenate(held)[:k]
            ok[: have.size] |= p[: have.size] == have
        if not ok.all():
            i = int((~ok).nonzero()[0][0])
            raise RequestError(
                f"{what}: device page {int(p[i])} (tokens from {i * self.page_size}) is "
                "neither the engine's nor the page the cache holds there"
            )

    def _check_finish(
        self, locs: torch.Tensor, prefix_len: int, handle: Handle | None
    ) -> np.ndarray:
        """``handle`` still locked, ``prefix_len`` the length ``load`` returned for it (0
        without a handle), ``locs`` starting with those slots and the engine's after them.
        Returns ``locs`` as checked slots (``_slots``)."""
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
        slots = self._slots(locs, "finish")
        if prefix_len > slots.size or (
            loaded is not None
            and not np.array_equal(slots[:prefix_len], loaded.reshape(-1).cpu().numpy())
        ):
            raise RequestError("finish: locs do not start with the slots load() returned")
        self._require_owned(slots[prefix_len:] // self.page_size, "finish")
        return slots

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

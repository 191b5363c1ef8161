"""Owner-preserving allocation and the per-rank shard of a node's write or load.

A logical page id lives on one rank (its lane, ``kvtier.parallel.layout``). A node's pages were
written by their owners; when the node is loaded back into fresh logical ids, page ``i`` must
get an id on lane ``page_owners[i]``, or the owner loads its bytes into a page that attention
reads from another rank, and the other rank's page is never filled (the model then emits
confident garbage). A plain free-list allocation ignores lanes, so it is checked and refused
(:func:`verify_owners`); :class:`OwnerAllocator` hands out ids lane by lane instead::

    cp_size = 2, zigzag owners of a 4-page node      0  1  1  0
    plain allocation (ids 0..3) → lanes               0  1  0  1   refused: pages 2, 3
    OwnerAllocator.alloc([0, 1, 1, 0])                0  1  3  2   lanes 0 1 1 0

Every rank runs the same allocator on the same requests, so the logical ids agree everywhere;
only the physical shard each rank moves differs (:func:`write_shard`, :func:`load_shard`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError, IntegrityError
from kvtier.parallel.layout import CPLayout
from kvtier.parallel.meta import CPNodeMeta


@dataclass(slots=True)
class ShardCopy:
    """The part of one node's device ↔ host copy that one rank performs."""

    node: int
    """Tree node id."""
    rank: int
    """The rank doing the copy."""
    positions: torch.Tensor
    """int64 node-local page positions moved (the rank's owned pages)."""
    device: torch.Tensor
    """int64 physical device pages on this rank, aligned with ``positions``."""
    host: torch.Tensor
    """int64 host pages on this rank, aligned with ``positions``."""

    @property
    def noop(self) -> bool:
        """Nothing to move here: the rank still acknowledges the node (zero-owned ack)."""
        return self.positions.numel() == 0


def verify_owners(
    layout: CPLayout, logical_pages: torch.Tensor, page_owners: torch.Tensor, node: int
) -> None:
    """Raise ``IntegrityError`` unless logical page ``i`` lives on rank ``page_owners[i]``."""
    pages = logical_pages.reshape(-1).cpu().to(torch.int64)
    owners = page_owners.reshape(-1).cpu().to(torch.int64)
    if pages.numel() != owners.numel():
        raise IntegrityError(
            f"node {node} rank {layout.rank}: {pages.numel()} logical pages for "
            f"{owners.numel()} saved owners"
        )
    bad = torch.nonzero(layout.lanes(pages) != owners).reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise IntegrityError(
            f"node {node} rank {layout.rank}: page {i} was written by rank {int(owners[i])} "
            f"but logical page {int(pages[i])} lives on rank {layout.lane(int(pages[i]))} "
            f"(pages {bad.tolist()} misplaced); allocate with the saved owners"
        )


class OwnerAllocator:
    """Free lists of logical page ids, one per lane; ``pages_per_rank`` physical pages each.

    Order is deterministic per lane (take from the front, free to the back), so every rank
    hands out the same ids for the same calls.
    """

    def __init__(self, layout: CPLayout, pages_per_rank: int, name: str = "cp-device") -> None:
        if (
            isinstance(pages_per_rank, bool)
            or not isinstance(pages_per_rank, int)
            or (pages_per_rank <= 0)
        ):
            raise ConfigError(
                f"{name}: pages_per_rank must be a positive integer, got {pages_per_rank!r}"
            )
        self.layout = layout
        self.name = name
        self.pages_per_rank = pages_per_rank
        n = layout.cp_size
        self._free: list[deque[int]] = [
            deque(p * n + lane for p in range(pages_per_rank)) for lane in range(n)
        ]
        self._used: set[int] = set()

    @property
    def num_pages(self) -> int:
        """Logical pages in all lanes together."""
        return self.layout.logical_pages(self.pages_per_rank)

    def available(self, lane: int) -> int:
        return len(self._free[lane])

    def shortfall(self, page_owners: Sequence[int]) -> dict[int, int]:
        """Pages missing per lane for ``alloc(page_owners)`` (empty when it would succeed): what
        an eviction targeting the short lanes must free."""
        need: dict[int, int] = {}
        for o in page_owners:
            self._check_lane(o)
            need[o] = need.get(o, 0) + 1
        return {
            lane: k - len(self._free[lane])
            for lane, k in sorted(need.items())
            if k > len(self._free[lane])
        }

    def alloc(self, page_owners: Sequence[int]) -> torch.Tensor | None:
        """One logical page id per entry, page ``i`` on lane ``page_owners[i]``; ``None`` (and
        nothing taken) when a lane is short."""
        if self.shortfall(page_owners):
            return None
        pages = [self._free[o].popleft() for o in page_owners]
        self._used.update(pages)
        return torch.tensor(pages, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Return pages to their lanes; a free page or an unknown id is an ``IntegrityError``
        (the batch is validated first, so a rejected call changes nothing)."""
        ids = pages.reshape(-1).tolist()
        seen: set[int] = set()
        for p in ids:
            if p not in self._used or p in seen:
                raise IntegrityError(
                    f"{self.name} rank {self.layout.rank}: free of page {p}, which is not in use"
                )
            seen.add(p)
        for p in ids:
            self._used.discard(p)
            self._free[self.layout.lane(p)].append(p)

    def _check_lane(self, owner: int) -> None:
        if not 0 <= owner < self.layout.cp_size:
            raise IntegrityError(
                f"{self.name} rank {self.layout.rank}: owner {owner} outside a group of "
                f"{self.layout.cp_size}"
            )


def write_shard(
    layout: CPLayout,
    node: int,
    logical_pages: torch.Tensor,
    page_owners: Sequence[int] | torch.Tensor,
    alloc_host: Callable[[int], torch.Tensor | None],
    page_size: int,
) -> tuple[CPNodeMeta, ShardCopy] | None:
    """This rank's part of backing up a node held at ``logical_pages``.

    Owned mask → physical device pages → ``alloc_host(owned count)``; a zero-owned rank never
    calls ``alloc_host`` and gets an empty (no-op) copy, but still a record of the node. ``None``
    when the host pool is short: evict at least :func:`owned_count` host pages (physical slots,
    not logical length) and retry.
    """
    owners = torch.as_tensor(page_owners, dtype=torch.int64).reshape(-1)
    verify_owners(layout, logical_pages, owners, node)
    positions = torch.nonzero(owners == layout.rank).reshape(-1)
    device = layout.physical(logical_pages.reshape(-1)[positions])
    if positions.numel():
        host = alloc_host(positions.numel())
        if host is None:
            return None
        host = host.reshape(-1).cpu().to(torch.int64)
    else:
        host = torch.empty(0, dtype=torch.int64)
    meta = CPNodeMeta.build(node, layout.rank, page_size, owners, host)
    return meta, ShardCopy(node, layout.rank, positions, device, host)


def owned_count(layout: CPLayout, page_owners: Sequence[int] | torch.Tensor) -> int:
    """Host pages this rank needs to back up a node with ``page_owners``."""
    owners = torch.as_tensor(page_owners, dtype=torch.int64).reshape(-1)
    return int((owners == layout.rank).sum())


def load_shard(layout: CPLayout, meta: CPNodeMeta, logical_pages: torch.Tensor) -> ShardCopy:
    """This rank's part of loading ``meta``'s node into fresh ``logical_pages``: refused with
    ``IntegrityError`` unless each page is on its saved owner."""
    if meta.rank != layout.rank:
        raise IntegrityError(
            f"node {meta.node} rank {layout.rank}: metadata belongs to rank {meta.rank}"
        )
    verify_owners(layout, logical_pages, meta.page_owners, meta.node)
    device = layout.physical(logical_pages.reshape(-1)[meta.owned_pages])
    return ShardCopy(meta.node, layout.rank, meta.owned_pages, device, meta.host_pages)


def load_nodes(
    allocator: OwnerAllocator, metas: Sequence[CPNodeMeta]
) -> tuple[torch.Tensor, list[ShardCopy]] | None:
    """Logical pages for a run of nodes (root side first), allocated with their saved owners,
    and each node's shard copy; ``None`` when a lane is short (``allocator.shortfall`` of the
    concatenated owners says how much to evict from which lane)."""
    owners = [o for m in metas for o in m.page_owners.tolist()]
    pages = allocator.alloc(owners)
    if pages is None:
        return None
    copies: list[ShardCopy] = []
    start = 0
    for m in metas:
        copies.append(load_shard(allocator.layout, m, pages[start : start + m.num_pages]))
        start += m.num_pages
    return pages, copies

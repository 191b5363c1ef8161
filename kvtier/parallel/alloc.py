"""The owner-preserving rule for context-parallel pages, and its check.

A logical page id lives on one rank (its lane, ``kvtier.parallel.layout``). A node's pages were
written by their owners; when the node is loaded back into fresh logical ids, page ``i`` must
get an id on lane ``page_owners[i]``, or the owner loads its bytes into a page that attention
reads from another rank, and the other rank's page is never filled. :func:`verify_owners`
refuses ids that break the rule; ``kvtier.pools.allocator.PageAllocator`` with ``lanes`` is the
allocator that follows it (``alloc_owned``)::

    cp_size = 2, zigzag owners of a 4-page node      0  1  1  0
    plain allocation (ids 0..3) → lanes               0  1  0  1   refused: pages 2, 3
    PageAllocator(8, lanes=2).alloc_owned(owners)     0  1  3  2   lanes 0 1 1 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.errors import IntegrityError
from kvtier.parallel.layout import CPLayout
from kvtier.parallel.meta import CPNodeMeta

if TYPE_CHECKING:
    from kvtier.tree.node import Node
    from kvtier.tree.radix import RadixTree


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


def node_meta(node: Node, layout: CPLayout, page_size: int) -> CPNodeMeta | None:
    """This rank's seed-003 record of ``node``'s host copy (``None`` without one), derived from
    the tree: the owners of its sequence pages and the host pages on this rank's lane.

    kvtier keeps the record derived rather than stored: every rank's tree holds the node's whole
    logical host copy (the same ids on every rank), and a logical id names its lane, so the
    owned positions and this rank's host slots follow from ``node.host`` alone. The tree's split
    slices ``node.host`` at a page boundary; the records derived from the two halves are exactly
    ``CPNodeMeta.split`` of the record before it (``tests/parallel/test_cp_meta.py``), so there is
    no second copy to keep in step. A node ending in a partial tail is recorded by its padded
    pages: the tail page is one page of its owner's shard, moved whole."""
    if node.host is None or node.parent is None:
        return None
    n, first = _pages(node, page_size)
    owners = torch.tensor(layout.owners(first, first + n), dtype=torch.int64)
    mine = node.host[owners == layout.rank]
    return CPNodeMeta.build(node.id, layout.rank, page_size, owners, layout.physical(mine))


def check_tree_owners(tree: RadixTree, layout: CPLayout) -> None:
    """Every copy of a node's page sits on the lane of the page's sequence owner (so each rank
    holds exactly its shard), and this rank's host shard of the node is a consistent seed-003
    record (owned positions, distinct host slots)."""
    ps = tree.page_size
    for node in tree.nodes():
        if node.parent is None:
            continue
        n, first = _pages(node, ps)
        owners = torch.tensor(layout.owners(first, first + n), dtype=torch.int64)
        for pages in (node.device, node.host):
            if pages is not None:
                verify_owners(layout, pages, owners, node.id)
        meta = node_meta(node, layout, ps)
        if meta is not None:
            meta.check(n * ps)  # a partial tail's record covers its padded page


def _pages(node: Node, page_size: int) -> tuple[int, int]:
    """``(pages, first sequence page)`` of ``node``: a partial tail is a page like any other,
    owned by the rank that owns its sequence page (nodes start on a page boundary)."""
    return node.num_pages(page_size), (node.depth_tokens() - node.num_tokens) // page_size

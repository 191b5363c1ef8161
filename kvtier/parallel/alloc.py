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


def check_tree_owners(tree: RadixTree, layout: CPLayout) -> None:
    """Every copy of a node's page sits on the lane of the page's sequence owner (so each rank
    holds exactly its shard), and this rank's host shard of the node is a consistent seed-003
    record (owned positions, distinct host slots)."""
    ps = tree.page_size
    for node in tree.nodes():
        if node.parent is None:
            continue
        n = node.num_tokens // ps
        first = node.depth_tokens() // ps - n
        owners = torch.tensor(layout.owners(first, first + n), dtype=torch.int64)
        for pages in (node.device, node.host):
            if pages is not None:
                verify_owners(layout, pages, owners, node.id)
        if node.host is not None:
            mine = node.host[owners == layout.rank]
            meta = CPNodeMeta.build(node.id, layout.rank, ps, owners, layout.physical(mine))
            meta.check(node.num_tokens)

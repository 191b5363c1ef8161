"""Per-rank metadata of a tree node's copy under context parallelism.

Under CP the tree stays logically complete (every rank holds the same nodes, lengths and
logical page ids), but a rank's host pool holds only the pages it owns. The node's host copy on
one rank is therefore described by this record rather than by one host page per node page:

    node of 5 pages, cp_size = 2, round-robin owners, this rank = 1
    node-local page        0  1  2  3  4
    page_owners            0  1  0  1  0      (identical on every rank)
    owned_pages               1     3         (positions where page_owners == rank)
    host_pages               h0    h1         (this rank's host pool; one per owned page)

Owned positions are node-local *page* positions (kvtier's tree addresses whole pages; the token
positions of the seeds' design are ``owned_positions()``), so they stay valid when the node's
logical ids are evicted and a load allocates new ones. ``page_owners`` is kept, not recomputed
from a pattern, because a load must put every page back on the rank that wrote it (see
``kvtier.parallel.alloc``). A rank that owns none of a node's pages has an empty shard (a
*zero-owned* node): it still records the node, so its tree decisions match the other ranks'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import IntegrityError


def _ids(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    # Long-lived tree metadata stays on the CPU: a GPU tensor here would pin device memory and
    # force a synchronisation on every read.
    return torch.as_tensor(values, dtype=torch.int64).reshape(-1).cpu()


@dataclass(slots=True, eq=False)
class CPNodeMeta:
    """One rank's view of one node's host copy. Build with :meth:`build`; every constructor
    path runs :meth:`check`, which raises ``IntegrityError`` naming node and rank."""

    node: int
    """Id of the tree node this describes (for error messages)."""
    rank: int
    """The rank this record belongs to."""
    page_size: int
    """Tokens per tree page."""
    logical_len: int
    """Tokens of the node, on every rank (``len(page_owners) * page_size``)."""
    page_owners: torch.Tensor
    """int64 owner rank of each node page; the same on every rank."""
    owned_pages: torch.Tensor
    """int64 ascending node-local page positions that ``rank`` owns."""
    host_pages: torch.Tensor
    """int64 host page ids of the owned pages, aligned with ``owned_pages``."""

    @classmethod
    def build(
        cls,
        node: int,
        rank: int,
        page_size: int,
        page_owners: Sequence[int] | torch.Tensor,
        host_pages: Sequence[int] | torch.Tensor,
    ) -> CPNodeMeta:
        """The record for a node whose pages have ``page_owners``; ``host_pages`` holds one host
        page per page ``rank`` owns (empty for a zero-owned node)."""
        owners = _ids(page_owners)
        owned = torch.nonzero(owners == rank).reshape(-1).to(torch.int64)
        meta = cls(
            node=node,
            rank=rank,
            page_size=page_size,
            logical_len=owners.numel() * page_size,
            page_owners=owners,
            owned_pages=owned,
            host_pages=_ids(host_pages),
        )
        meta.check()
        return meta

    @property
    def num_pages(self) -> int:
        return self.page_owners.numel()

    @property
    def owned_count(self) -> int:
        """Pages this rank holds: the host slots its shard uses (eviction progress)."""
        return self.owned_pages.numel()

    @property
    def zero_owned(self) -> bool:
        """This rank owns none of the node's pages: no bytes, no transfer, a no-op ack."""
        return self.owned_pages.numel() == 0

    def owned_positions(self) -> torch.Tensor:
        """Node-local token positions of the owned pages (the seeds' ``owned_positions``)."""
        ps = self.page_size
        offs = torch.arange(ps, dtype=torch.int64)
        return (self.owned_pages.unsqueeze(1) * ps + offs).reshape(-1)

    def check(self, logical_len: int | None = None) -> None:
        """Raise ``IntegrityError`` unless the record is self-consistent (and, when given,
        describes a node of ``logical_len`` tokens)."""
        where = f"node {self.node} rank {self.rank}"
        if self.page_size < 1:
            raise IntegrityError(f"{where}: page_size must be positive, got {self.page_size}")
        for name in ("page_owners", "owned_pages", "host_pages"):
            t = getattr(self, name)
            if t.device.type != "cpu" or t.dtype != torch.int64 or t.dim() != 1:
                raise IntegrityError(
                    f"{where}: {name} must be a 1-D int64 CPU tensor, got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                )
        n = self.num_pages
        if self.logical_len != n * self.page_size:
            raise IntegrityError(
                f"{where}: logical_len={self.logical_len} is not {n} pages of {self.page_size}"
            )
        if logical_len is not None and logical_len != self.logical_len:
            raise IntegrityError(
                f"{where}: metadata covers {self.logical_len} tokens, the node has {logical_len}"
            )
        if n and (int(self.page_owners.min()) < 0):
            raise IntegrityError(f"{where}: negative page owner in {self.page_owners.tolist()}")
        expect = torch.nonzero(self.page_owners == self.rank).reshape(-1)
        if not torch.equal(self.owned_pages, expect):
            raise IntegrityError(
                f"{where}: owned_pages {self.owned_pages.tolist()} disagree with page_owners "
                f"{self.page_owners.tolist()} (expected {expect.tolist()})"
            )
        if self.host_pages.numel() != self.owned_pages.numel():
            raise IntegrityError(
                f"{where}: {self.host_pages.numel()} host pages for "
                f"{self.owned_pages.numel()} owned pages"
            )
        if self.host_pages.numel() and (
            int(self.host_pages.min()) < 0
            or self.host_pages.unique().numel() != self.host_pages.numel()
        ):
            raise IntegrityError(
                f"{where}: host pages must be distinct and >= 0, got {self.host_pages.tolist()}"
            )

    def split(self, at_page: int, parent_node: int) -> tuple[CPNodeMeta, CPNodeMeta]:
        """Records for the first ``at_page`` pages (the new parent ``parent_node``, as the
        tree's split creates it) and the rest (this node, positions rebased to its start).

        Host pages follow their owned positions, not the first ``at_page`` host entries: on a
        rank that owns pages 1 and 3 of the table above, ``split(2)`` gives the parent ``[1]``
        with ``h0`` and the child ``[1]`` (old 3) with ``h1``. Only interior page boundaries
        are split points (``0 < at_page < num_pages``).
        """
        if isinstance(at_page, bool) or not isinstance(at_page, int):
            raise IntegrityError(
                f"node {self.node} rank {self.rank}: split point must be a page count, "
                f"got {at_page!r}"
            )
        if not 0 < at_page < self.num_pages:
            raise IntegrityError(
                f"node {self.node} rank {self.rank}: split at page {at_page} is not inside "
                f"the node's {self.num_pages} pages"
            )
        before = self.owned_pages < at_page
        parent = CPNodeMeta(
            node=parent_node,
            rank=self.rank,
            page_size=self.page_size,
            logical_len=at_page * self.page_size,
            page_owners=self.page_owners[:at_page].clone(),
            owned_pages=self.owned_pages[before].clone(),
            host_pages=self.host_pages[before].clone(),
        )
        child = CPNodeMeta(
            node=self.node,
            rank=self.rank,
            page_size=self.page_size,
            logical_len=self.logical_len - parent.logical_len,
            page_owners=self.page_owners[at_page:].clone(),
            owned_pages=self.owned_pages[~before] - at_page,
            host_pages=self.host_pages[~before].clone(),
        )
        parent.check()
        child.check()
        return parent, child

    def __repr__(self) -> str:
        return (
            f"CPNodeMeta(node={self.node}, rank={self.rank}, pages={self.num_pages}, "
            f"owned={self.owned_pages.tolist()}, host={self.host_pages.tolist()})"
        )

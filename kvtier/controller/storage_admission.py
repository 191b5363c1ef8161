"""Which host copies are worth writing to storage (``CacheConfig.storage_admission``).

``all`` writes every host copy storage lacks. ``cost`` writes a page only where reading it back
beats computing it again: its recompute time (the work of its tokens at their depth,
``kvtier.tree.recompute``, at the prefill rate) must be at least its storage bytes at the
storage read rate (the rates ``kvtier.controller.restore_cost`` measures). Until the read rate
has a measurement (or with ``restore_rate_weight=0``, whose priors are the rates) everything
is written.

A storage hit is a run of present keys from where the tree's match ends (contract 7 chains
each key to the one before), so a page after a missing one is of no use once the missing page
left the tree. A node is therefore written only if every node of its path that storage lacks
(itself included) is worth writing, each judged by its first page: the least worth of its
pages, as a page's work grows with its depth. Passed-over nodes are just not stored:
``in_storage`` stays false, and a later use asks again (at the rates of then).
"""

from __future__ import annotations

from typing import Protocol

from kvtier.metrics import Metrics
from kvtier.tree.node import Node
from kvtier.tree.recompute import RecomputeWork


class Rates(Protocol):
    """The measured rates admission reads (``restore_cost.CostModel`` is one)."""

    def seconds(self, path: str, amount: float) -> float:
        """How long ``amount`` takes through ``path`` (``storage_read``: bytes; ``prefill``:
        tokens)."""
        ...

    def known(self, path: str) -> bool:
        """Whether ``path``'s rate is measured (not a prior)."""
        ...


class StorageAdmission:
    """The ``storage_admission`` rule of one cache; ``on`` is ``cost``."""

    def __init__(
        self, on: bool, work: RecomputeWork, rates: Rates, page_size: int, metrics: Metrics
    ) -> None:
        self.on = on
        self.work = work
        self.rates = rates
        self.page_size = page_size
        self.metrics = metrics

    def worth(self, node: Node, page_bytes: float) -> bool:
        """Whether ``node``'s first page saves at least the time a read of its ``page_bytes``
        from storage takes."""
        tokens = min(self.page_size, node.num_tokens)
        saved = self.rates.seconds("prefill", self.work.tokens(node.depth, tokens))
        return saved >= self.rates.seconds("storage_read", page_bytes)

    def admit(self, nodes: list[Node], page_bytes: float) -> list[Node]:
        """The ``nodes`` (host copies storage lacks) to write, in order; the pages of the others
        are counted in ``skipped_storage_writes``."""
        if not self.on or not nodes or not self.rates.known("storage_read"):
            return nodes
        decided: dict[int, bool] = {}  # by node id: whether its path is worth writing

        def verdict(node: Node) -> bool:
            chain: list[Node] = []
            n: Node | None = node
            while n is not None and n.parent is not None and n.id not in decided:
                chain.append(n)
                n = n.parent
            ok = decided.get(n.id, True) if n is not None else True
            for c in reversed(chain):  # from the shallowest down
                ok = ok and (c.in_storage or self.worth(c, page_bytes))
                decided[c.id] = ok
            return ok

        out = []
        for node in nodes:
            if verdict(node):
                out.append(node)
            else:
                self.metrics.inc("skipped_storage_writes", node.num_pages(self.page_size))
        return out

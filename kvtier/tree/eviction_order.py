"""Eviction order: the policies (LRU, LFU, cost) that say which unlocked leaf of a tier goes
first. Smaller priority is evicted first.

A priority should not decrease while a node stays in a tier: the eviction queues
(``kvtier.tree.eviction``) find a node at the priority it was queued at, re-queueing it at its
current one only when it reaches the top. The tree tells the policy when a node's copy in a tier is used
(``touch``: a copy made, a hit, a re-insert) and when the policy's choice evicted it
(``evicted``).

``cost`` is GreedyDual-Size (Cao and Irani, 1997) per tier: a copy's credit is
``H = L + savings / bytes`` when it is made or used, ``savings`` being the work of computing
its tokens again at their depth (``kvtier.tree.recompute``) and ``bytes`` its pages' bytes in
that tier; the copy with the smallest credit goes first and its credit becomes the tier's ``L``
(the inflation), so a copy not used for long loses to newer ones whatever it saves. Device
and host each keep their own ``L``. A split keeps both parts' credits; the shallower part's
next use may give it less (it saves less per byte), and the queue then meets it at the older
credit: evicted a little later than strict order says, never wrongly.
"""

from __future__ import annotations

from typing import Protocol

from kvtier.errors import ConfigError
from kvtier.tree.node import CopyTier, Node
from kvtier.tree.recompute import RecomputeWork


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: Node, tier: CopyTier) -> tuple[float, ...]:
        """Sort key of ``node``'s copy in ``tier``; the smallest is evicted first."""
        ...

    def touch(self, node: Node, tier: CopyTier | None = None) -> None:
        """``node``'s copy in ``tier`` (``None``: every tier holding one) was made or used."""
        ...

    def evicted(self, node: Node, tier: CopyTier) -> None:
        """``node``'s copy in ``tier`` was evicted as this policy's choice."""
        ...


class _Recency:
    """Orders by the node's own counters (``last_access``, ``hits``): nothing to track."""

    name = ""

    def touch(self, node: Node, tier: CopyTier | None = None) -> None:
        pass

    def evicted(self, node: Node, tier: CopyTier) -> None:
        pass


class LRU(_Recency):
    name = "lru"

    def priority(self, node: Node, tier: CopyTier) -> tuple[float, ...]:
        return (node.last_access, node.id)


class LFU(_Recency):
    name = "lfu"

    def priority(self, node: Node, tier: CopyTier) -> tuple[float, ...]:
        return (node.hits, node.last_access, node.id)


class GreedyDualSize:
    """``cost``: GreedyDual-Size per tier (the module). Ties in credit go least recently
    used first."""

    name = "cost"

    def __init__(self, work: RecomputeWork, page_bytes: dict[str, float], page_size: int) -> None:
        """``page_bytes``: bytes of one page in each tier (``device``, ``host``)."""
        for tier in ("device", "host"):
            if not page_bytes.get(tier, 0) > 0:
                raise ConfigError(f"eviction_policy='cost': no page bytes for the {tier} tier")
        self.work = work
        self.page_bytes = dict(page_bytes)
        self.page_size = page_size
        self.inflation: dict[str, float] = {"device": 0.0, "host": 0.0}
        """Each tier's ``L``: the credit of its last evicted copy (never decreasing)."""

    def value(self, node: Node, tier: CopyTier) -> float:
        """``savings / bytes`` of ``node``'s pages in ``tier``: recompute work per byte."""
        saved = self.work.tokens(node.depth, node.num_tokens)
        return saved / (node.num_pages(self.page_size) * self.page_bytes[tier])

    def priority(self, node: Node, tier: CopyTier) -> tuple[float, ...]:
        credit = node.device_credit if tier == "device" else node.host_credit
        return (credit, node.last_access, node.id)

    def touch(self, node: Node, tier: CopyTier | None = None) -> None:
        if tier in (None, "device"):
            node.device_credit = self.inflation["device"] + self.value(node, "device")
        if tier in (None, "host"):
            node.host_credit = self.inflation["host"] + self.value(node, "host")

    def evicted(self, node: Node, tier: CopyTier) -> None:
        credit = node.device_credit if tier == "device" else node.host_credit
        # ``max``: a busy candidate passed over may be evicted later below the current L
        self.inflation[tier] = max(self.inflation[tier], credit)


def make_policy(
    name: str,
    work: RecomputeWork | None = None,
    page_bytes: dict[str, float] | None = None,
    page_size: int = 1,
) -> EvictionPolicy:
    """The policy ``name`` (``CacheConfig.eviction_policy``). ``cost`` prices pages with
    ``work`` and ``page_bytes`` per tier (default: a context of 4096 tokens, one byte a page:
    for trees without pools)."""
    if name == "cost":
        return GreedyDualSize(
            work or RecomputeWork(4096.0),
            page_bytes or {"device": 1.0, "host": 1.0},
            page_size,
        )
    policies: dict[str, type] = {"lru": LRU, "lfu": LFU}
    if name not in policies:
        names = ", ".join([*policies, "cost"])
        raise ConfigError(f"eviction_policy={name!r} is not one of {names}")
    return policies[name]()

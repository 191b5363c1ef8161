"""Residency changes and eviction queues: an object the radix tree owns and notifies.

``EvictionIndex`` keeps, across calls, a priority queue of device-eviction candidates (device
leaves: device-resident nodes without a device-resident child) and one of host-eviction
candidates (host copies whose node keeps a device copy, or unlocked host-only leaves), instead
of scanning the tree per call. The tree tells it when a node's residency, locks or shape change
(``refresh_leaf``, ``queue_device``, ``queue_host``); the residency writers below are the tree's
(``RadixTree.set_device`` and friends delegate here), so node state still changes only inside
``kvtier.tree``. Entries go stale (the node stopped being a candidate, got locked, or was
accessed since) and are dropped or re-queued when they reach the top, which is sound because
priorities only grow (a ``cost`` credit that drops after a split only delays that node's turn,
``kvtier.tree.eviction_order``). Invariants, checked by ``check``: every unlocked device leaf has a device
entry; every host candidate has a host entry.

Every device and host residency change passes through here, so this is also where a
``ResidencyListener`` (KV events, ``kvtier.events``) hears of them: told while the node is still
attached and holds its tokens, after the change for a copy that arrives and before the node
leaves the tree for one that goes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from kvtier.errors import IntegrityError
from kvtier.tree.node import CopyTier, Node
from kvtier.tree.results import Evicted
from kvtier.tree.tokens import TOKEN_BYTES

if TYPE_CHECKING:
    from kvtier.tree.eviction_order import EvictionPolicy
    from kvtier.tree.token_arena import TokenArena


class IndexedTree(Protocol):
    """What the eviction index reads of its tree (``RadixTree`` is one)."""

    page_size: int
    root: Node
    policy: EvictionPolicy
    arena: TokenArena

    def nodes(self) -> Iterator[Node]:
        """Every node except the root."""
        ...

    def subtree(self, node: Node) -> Iterator[Node]:
        """``node`` and every node below it."""
        ...


class ResidencyListener(Protocol):
    """Told of every change of which tiers hold a node's pages (``RadixTree.listen``)."""

    def changed(self, node: Node, tier: str, resident: bool) -> None:
        """``node``'s pages became resident in ``tier`` (``device``, ``host``, ``storage``)
        or stopped being resident there. ``node`` is attached to the tree during the call
        (its ancestors give its prefix) and must not be changed."""
        ...


class EvictionIndex:
    """The eviction queues of one ``RadixTree`` (``tree``) and the residency changes that
    keep them current."""

    def __init__(self, tree: IndexedTree) -> None:
        self.tree = tree
        self.device_leaves: set[Node] = set()
        self._device_heap: list[tuple] = []
        self._host_heap: list[tuple] = []
        self.hosted = 0
        """Nodes holding a host copy (sizes the host queue's compaction)."""
        self._seq = itertools.count()
        self.listener: ResidencyListener | None = None
        """Told of every residency change (``RadixTree.listen``); ``None``: nobody listens."""

    def tell(self, node: Node, tier: str, resident: bool) -> None:
        """Pass a residency change to the listener, if any (the tree's writers call it)."""
        if self.listener is not None:
            self.listener.changed(node, tier, resident)

    def set_device(self, node: Node, pages: torch.Tensor) -> None:
        """Record ``pages`` as ``node``'s device copy (its parent must be device-resident)."""
        node.device = pages
        self.tell(node, "device", True)
        self.tree.policy.touch(node, "device")
        self.refresh_leaf(node)
        # The parent now has a device child, so it is no leaf: no scan of its children.
        if node.parent is not None:
            self.device_leaves.discard(node.parent)
        if node.host is not None:
            self.queue_host(node)

    def drop_host(self, node: Node) -> torch.Tensor:
        """Forget ``node``'s host copy (it must keep a device copy); returns the pages, which the
        caller frees."""
        if node.host is None or node.device is None:
            raise IntegrityError(f"drop_host of {node!r}: needs a host and a device copy")
        pages, node.host = node.host, None
        self.hosted -= 1
        self.tell(node, "host", False)
        return pages

    def set_host(self, node: Node, pages: torch.Tensor) -> None:
        """Record ``pages`` as the host copy of ``node``, which has none."""
        if node.host is not None:
            raise IntegrityError(f"{node!r} already has a host copy")
        node.host = pages
        self.hosted += 1
        self.tell(node, "host", True)
        self.tree.policy.touch(node, "host")
        self.queue_host(node)

    def refresh_leaf(self, node: Node) -> None:
        if (
            node is not self.tree.root
            and node.device is not None
            and (not node.children or not any(c.device is not None for c in node.children.values()))
        ):
            if node not in self.device_leaves:
                self.device_leaves.add(node)
                self.queue_device(node)
        else:
            self.device_leaves.discard(node)

    def queue_device(self, node: Node) -> None:
        """Give ``node`` an eviction-queue entry at its current priority."""
        heap = self._device_heap
        if len(heap) > 2 * len(self.device_leaves) + 1024:  # mostly stale: rebuild
            heap[:] = [self._entry(n, "device") for n in self.device_leaves if not n.lock_ref]
            heapq.heapify(heap)
            return  # ``node`` is a leaf: queued by the rebuild unless locked
        heapq.heappush(heap, self._entry(node, "device"))

    def queue_host(self, node: Node) -> None:
        """Give ``node`` a host-eviction entry (checked when it reaches the top)."""
        heap = self._host_heap
        if len(heap) > 2 * self.hosted + 1024:  # mostly stale: rebuild
            heap[:] = [self._entry(n, "host") for n in self.tree.nodes() if self._host_candidate(n)]
            heapq.heapify(heap)
            return
        heapq.heappush(heap, self._entry(node, "host"))

    def evict_device(
        self,
        num_pages: int,
        prepare: Callable[[Node], bool] | None = None,
        weight: Callable[[torch.Tensor], int] | None = None,
    ) -> Evicted:
        """Drop device copies of at least ``num_pages`` pages (fewer if not possible).

        Candidates are unlocked, idle device leaves. ``prepare(node)`` may refuse one (return
        False) or make a host copy first. A node left with no copy is removed with its host-only
        subtree. ``weight(pages)`` counts what dropping ``pages`` achieves (default: all of
        them; a context-parallel rank counts only the pages of the lanes it is short of).
        """
        out = Evicted()

        def take(node: Node) -> int:
            if node.device is None:
                raise IntegrityError(f"device eviction of {node!r} without a device copy")
            out.device_pages.append(node.device)
            n = node.device.numel() if weight is None else weight(node.device)
            self.tree.policy.evicted(node, "device")
            node.device = None
            self.tell(node, "device", False)
            self.device_leaves.discard(node)
            parent = node.parent
            if not node.on_host:
                self._remove_subtree(node, out)
            if parent is not None:
                self.refresh_leaf(parent)  # queues the parent when it became a leaf
            return n

        self._drain(
            self._device_heap,
            "device",
            num_pages,
            # stale, or locked: ``unlock`` queues it again
            candidate=lambda n: n in self.device_leaves and not n.lock_ref,
            busy=lambda n: not self._device_evictable(n, prepare),
            take=take,
        )
        return out

    def evict_host(
        self, num_pages: int, weight: Callable[[torch.Tensor], int] | None = None
    ) -> Evicted:
        """Drop host copies of at least ``num_pages`` pages (fewer if not possible); ``weight``
        as for ``evict_device``."""
        out = Evicted()

        def take(node: Node) -> int:
            if node.host is None:
                raise IntegrityError(f"host eviction of {node!r} without a host copy")
            out.host_pages.append(node.host)
            n = node.host.numel() if weight is None else weight(node.host)
            self.tree.policy.evicted(node, "host")
            node.host = None
            self.hosted -= 1
            self.tell(node, "host", False)
            if not node.on_device:
                self._detach(node)  # queues the parent when it became a host-only leaf
                self.tree.arena.release(node)
                out.removed_nodes += 1
            return n

        self._drain(
            self._host_heap,
            "host",
            num_pages,
            candidate=lambda n: n.parent is not None and self._host_candidate(n),
            busy=lambda n: bool(n.host_io),
            take=take,
        )
        return out

    def _drain(
        self,
        heap: list[tuple],
        tier: CopyTier,
        num_pages: int,
        candidate: Callable[[Node], bool],
        busy: Callable[[Node], bool],
        take: Callable[[Node], int],
    ) -> None:
        """Pop ``heap`` (``tier``'s queue) until ``take`` freed ``num_pages`` pages or it is empty.

        Entries whose node is no longer a ``candidate`` are dropped (whatever makes it one again
        queues it); entries older than their node's priority are re-queued at it; ``busy``
        candidates are set aside and queued again at the end.
        """
        aside: list[tuple] = []
        freed = 0
        while freed < num_pages and heap:
            entry = heapq.heappop(heap)
            node = entry[-1]
            if not candidate(node):
                continue
            current = self._entry(node, tier)
            if current[0] != entry[0]:  # accessed since queued
                heapq.heappush(heap, current)
                continue
            if busy(node):
                aside.append(entry)
                continue
            freed += take(node)
        for entry in aside:
            heapq.heappush(heap, entry)

    def _entry(self, node: Node, tier: CopyTier) -> tuple:
        # The sequence number keeps two entries of one node from ever comparing nodes.
        return (self.tree.policy.priority(node, tier), next(self._seq), node)

    def _device_evictable(self, node: Node, prepare: Callable[[Node], bool] | None = None) -> bool:
        """Whether ``node``'s device copy can go now. ``prepare`` runs before the check that
        nothing below reads host pages: a host copy it makes keeps that subtree attached."""
        if node is self.tree.root or node.device is None or node.lock_ref or node.device_io:
            return False
        if any(c.on_device for c in node.children.values()):
            return False
        if prepare is not None and not prepare(node):
            return False
        return node.on_host or not any(d.host_io for d in self.tree.subtree(node))

    def _host_candidate(self, node: Node) -> bool:
        """Whether ``node``'s host copy can go, I/O aside: the device copy stays, or it is an
        unlocked leaf."""
        if node is self.tree.root or node.host is None:
            return False
        return node.on_device or (not node.children and not node.lock_ref)

    def _remove_subtree(self, node: Node, out: Evicted) -> None:
        for d in self.tree.subtree(node):
            self.device_leaves.discard(d)
            if d is not node and d.host is not None:
                out.host_pages.append(d.host)
                d.host = None
                self.hosted -= 1
                self.tell(d, "host", False)
            out.removed_nodes += 1
            self.tree.arena.release(d)
        self._detach(node)

    def drop_leaf(self, node: Node, out: Evicted) -> None:
        """Remove the leaf ``node`` with all its copies (a partial tail a longer version
        replaces; the caller checked it is unlocked and idle); its pages go to ``out``."""
        if node.children:
            raise IntegrityError(f"drop_leaf of {node!r} with children")
        if node.device is not None:
            out.device_pages.append(node.device)
            node.device = None
            self.tell(node, "device", False)
        if node.host is not None:
            out.host_pages.append(node.host)
            node.host = None
            self.hosted -= 1
            self.tell(node, "host", False)
        self.device_leaves.discard(node)
        parent = node.parent
        self._detach(node)
        self.tree.arena.release(node)
        out.removed_nodes += 1
        if parent is not None:
            self.refresh_leaf(parent)

    def _detach(self, node: Node) -> None:
        page = self.tree.page_size * TOKEN_BYTES
        parent = node.parent
        key = bytes(node.buf[:page])
        if parent is None or parent.children.get(key) is not node:
            raise IntegrityError(f"detach of a node not attached to its parent: {node!r}")
        del parent.children[key]
        parent.tails -= len(key) < page
        node.parent = None
        if parent.host is not None and not parent.children and parent is not self.tree.root:
            self.queue_host(parent)

    def check(self, leaves: set[Node]) -> None:
        """The queue invariants (``leaves``: the device leaves, recomputed by the caller)."""
        queued = {id(e[-1]) for e in self._device_heap}
        missing = [n.id for n in leaves if not n.lock_ref and id(n) not in queued]
        if missing:
            raise IntegrityError(
                f"unlocked device leaves missing from the eviction queue: {missing}"
            )
        queued = {id(e[-1]) for e in self._host_heap}
        missing = [
            n.id for n in self.tree.nodes() if self._host_candidate(n) and id(n) not in queued
        ]
        if missing:
            raise IntegrityError(f"host eviction candidates missing from the queue: {missing}")
        hosted = sum(n.host is not None for n in self.tree.nodes())
        if hosted != self.hosted:
            raise IntegrityError(f"{hosted} nodes hold host copies, {self.hosted} counted")

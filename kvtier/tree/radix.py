"""Radix tree over pages.

The tree records which prefixes are cached and where (device/host page ids, storage flag). It
never allocates or frees memory: ``insert`` reports the caller's pages it did not take and
``evict_*`` report the pages they dropped; the caller returns them to the allocators.

Lock protocol: ``match`` is read-only and returns a ``TreeMatch``; the caller ``lock``s the match
before any other tree call (which may split the matched node so the lock covers exactly the
matched pages) and ``unlock``s it when done. A locked node keeps a usable copy in some tier.
Residency changes and eviction are in ``kvtier.tree.eviction``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from kvtier.errors import IntegrityError
from kvtier.keys import Namespace, PageKey, chain_keys
from kvtier.tree.eviction import EvictionIndex
from kvtier.tree.node import Node
from kvtier.tree.policy import EvictionPolicy, make_policy
from kvtier.tree.results import Evicted, InsertOutcome, TreeMatch

_EMPTY = torch.empty(0, dtype=torch.int64)


CopyTier = Literal["device", "host"]
"""The tiers that hold page copies a node records (storage holds objects, by key)."""

SplitHook = Callable[[Node, Node, int], None]
"""Called as ``hook(prefix, suffix, n_pages)`` after ``suffix`` lost its first pages to a new
parent ``prefix``; owners of in-flight work on ``suffix`` re-attribute it."""


class RadixTree:
    """Pages of ``page_size`` tokens; nodes split only on page boundaries."""

    def __init__(self, page_size: int, policy: EvictionPolicy | str = "lru") -> None:
        self.page_size = page_size
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = Node(id=0, parent=None, tokens=())
        self.split_hooks: list[SplitHook] = []
        self.eviction = EvictionIndex(self)
        """The eviction queues, told of every residency, lock and shape change."""

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> TreeMatch:
        """Longest cached prefix of ``tokens`` in whole pages. Never mutates."""
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node, pos, path, last = self.root, 0, [], 0
        device_len = host_len = 0
        while pos < end:
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            # Only the span this node covers is converted: a miss costs one page, not the prompt.
            span = tuple(tokens[pos : min(end, pos + len(child.tokens))])
            n = self._common_pages(child, span, 0)
            path.append(child)
            last = n
            if child.on_device:
                device_len += n * ps
            else:
                host_len += n * ps
            pos += n * ps
            if n < child.num_pages(ps):
                break
            node = child
        return TreeMatch(path=path, last_pages=last, device_len=device_len, host_len=host_len)

    def _common_pages(self, node: Node, t: tuple[int, ...], pos: int) -> int:
        """Whole pages ``node.tokens`` shares with ``t[pos:]`` (at least the first one)."""
        ps, nt = self.page_size, node.tokens
        if t[pos : pos + len(nt)] == nt:
            return len(nt) // ps
        n = 1  # the first page matched through the children dict
        while (n + 1) * ps <= len(nt) and nt[n * ps : (n + 1) * ps] == t[
            pos + n * ps : pos + (n + 1) * ps
        ]:
            n += 1
        return n

    # ---- locking ------------------------------------------------------------------------
    def lock(self, m: TreeMatch) -> Node:
        """Pin the matched prefix; splits a partially matched last node. Returns the lock node."""
        node = m.node
        if node is None:
            return self.root
        if node.parent is None and node is not self.root:
            raise IntegrityError(f"lock of a detached node {node!r}: lock right after match")
        if m.last_pages < node.num_pages(self.page_size):
            node = self._split(node, m.last_pages)
            m.path[-1] = node
            m.last_pages = node.num_pages(self.page_size)
        self.lock_node(node)
        return node

    def lock_node(self, node: Node, hit: bool = True) -> None:
        """Pin ``node`` and its ancestors (``hit`` also refreshes recency and hit counts)."""
        now = next(self._clock)
        n: Node | None = node
        while n is not None and n is not self.root:
            n.lock_ref += 1
            if hit:
                n.hits += 1
                n.last_access = now
            n = n.parent

    def unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                raise IntegrityError(f"unlock below zero at {n!r}")
            n.lock_ref -= 1
            if not n.lock_ref:
                if n in self.eviction.device_leaves:
                    self.eviction.queue_device(n)
                if n.host is not None and not n.children:
                    self.eviction.queue_host(n)
            n = n.parent

    # ---- insertion ----------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        pages: torch.Tensor,
        tier: CopyTier = "device",
        keys: list[PageKey] | None = None,
        start: Node | None = None,
        checkpoints: torch.Tensor | None = None,
    ) -> InsertOutcome:
        """Record ``pages`` (one id per whole page of ``tokens``) as copies in ``tier``.

        Existing nodes lacking a copy in ``tier`` adopt the caller's pages; pages of nodes that
        already have one are returned as duplicates. ``keys`` (one per page) marks the pages as
        present in storage too (used when they were fetched from L3). ``start`` (a locked node,
        default the root) is where ``tokens`` begin; ``cached_len`` is relative to it.
        ``checkpoints`` (bool per page, state models) says which pages' state rows are valid; a
        node adopting a copy keeps a checkpoint only where both copies have one.
        """
        ps = self.page_size
        if len(tokens) % ps or pages.numel() != len(tokens) // ps:
            raise IntegrityError(
                f"insert of {len(tokens)} tokens with {pages.numel()} pages (page_size={ps})"
            )
        t = tuple(tokens)
        node, pos, cached, prefix = start or self.root, 0, 0, True
        dups: list[torch.Tensor] = []
        taken: list[Node] = []
        now = next(self._clock)
        while pos < len(t):
            p0 = pos // ps
            child = node.children.get(t[pos : pos + ps])
            if child is None:
                child = Node(id=next(self._ids), parent=node, tokens=t[pos:])
                node.children[t[pos : pos + ps]] = child
                self._set_copy(child, tier, pages[p0:])
                if checkpoints is not None:
                    child.ckpt = checkpoints[p0:].clone()
                if keys is not None:
                    child.keys, child.in_storage = list(keys[p0:]), True
                child.last_access = now
                taken.append(child)
                node = child
                break
            n = self._common_pages(child, t, pos)
            if n < child.num_pages(ps):
                child = self._split(child, n)
            if self._copy(child, tier) is not None:
                dups.append(pages[p0 : p0 + n])
                if prefix:
                    cached = pos + n * ps
            else:
                prefix = False
                self._set_copy(child, tier, pages[p0 : p0 + n])
                if checkpoints is not None and child.ckpt is not None:
                    child.ckpt = child.ckpt & checkpoints[p0 : p0 + n]
                taken.append(child)
            if keys is not None and not child.in_storage:
                child.keys, child.in_storage = list(keys[p0 : p0 + n]), True
            child.last_access = now
            pos += n * ps
            node = child
        dup = torch.cat(dups) if dups else _EMPTY
        return InsertOutcome(cached_len=cached, duplicates=dup, taken=taken, last=node)

    @staticmethod
    def _copy(node: Node, tier: CopyTier) -> torch.Tensor | None:
        if tier == "device":
            return node.device
        if tier == "host":
            return node.host
        raise IntegrityError(f"tier={tier!r} holds no page copies (device or host)")

    def _set_copy(self, node: Node, tier: CopyTier, pages: torch.Tensor) -> None:
        if tier == "device":
            self.set_device(node, pages)
        elif tier == "host":
            self.set_host(node, pages)
        else:
            raise IntegrityError(f"unknown tier {tier!r}")

    def _split(self, node: Node, n: int) -> Node:
        """Move the first ``n`` pages of ``node`` into a new parent; returns the new parent."""
        ps, k = self.page_size, n * self.page_size
        parent = node.parent
        if parent is None:
            raise IntegrityError(f"split of a node outside the tree: {node!r}")
        new = Node(id=next(self._ids), parent=parent, tokens=node.tokens[:k])
        new.device = node.device[:n] if node.device is not None else None
        new.host = node.host[:n] if node.host is not None else None
        new.keys = node.keys[:n] if node.keys is not None else None
        new.ckpt = node.ckpt[:n] if node.ckpt is not None else None
        new.in_storage, new.origin = node.in_storage, node.origin
        self.eviction.hosted += new.host is not None
        new.lock_ref, new.device_io, new.host_io = node.lock_ref, node.device_io, node.host_io
        new.last_access, new.hits = node.last_access, node.hits
        parent.children[node.tokens[:ps]] = new
        node.tokens = node.tokens[k:]
        node.device = node.device[n:] if node.device is not None else None
        node.host = node.host[n:] if node.host is not None else None
        node.keys = node.keys[n:] if node.keys is not None else None
        node.ckpt = node.ckpt[n:] if node.ckpt is not None else None
        node.parent = new
        new.children[node.tokens[:ps]] = node
        self.eviction.refresh_leaf(new)
        if new.host is not None:
            self.eviction.queue_host(new)
        for hook in self.split_hooks:
            hook(new, node, n)
        return new

    def set_in_storage(self, node: Node, stored: bool) -> None:
        """Record whether storage holds every page object of ``node`` (``False``: one was
        found gone, so a backup writes the node again)."""
        node.in_storage = stored

    def set_origin(self, node: Node, origin: str | None) -> None:
        """Record the tier ``node``'s newest copy came from until an admission counted it
        (``None``: counted, hits are hits of the tier it is in)."""
        node.origin = origin

    def begin_io(self, node: Node, tier: CopyTier) -> None:
        """A transfer starts reading (device) or reading/writing (host) ``node``'s copy in
        ``tier``: eviction keeps that copy until the matching ``end_io``."""
        if tier == "device":
            if node.device is None:
                raise IntegrityError(f"device I/O on {node!r} without a device copy")
            node.device_io += 1
        elif tier == "host":
            node.host_io += 1
        else:
            raise IntegrityError(f"I/O on unknown tier {tier!r}")

    def end_io(self, node: Node, tier: CopyTier) -> None:
        """The transfer ``begin_io`` announced completed (or was abandoned)."""
        if tier not in ("device", "host"):
            raise IntegrityError(f"end of I/O on unknown tier {tier!r}")
        count = node.device_io if tier == "device" else node.host_io
        if count <= 0:
            raise IntegrityError(f"end of {tier} I/O on {node!r} with none in flight")
        if tier == "device":
            node.device_io -= 1
        else:
            node.host_io -= 1

    def split(self, node: Node, pages: int) -> Node:
        """Split ``node`` after its first ``pages`` pages; returns the new parent (the first
        part). Locks, I/O counts and copies are shared by both parts; split hooks re-attribute
        in-flight work."""
        if not 0 < pages < node.num_pages(self.page_size):
            raise IntegrityError(f"split of {node!r} at page {pages}")
        return self._split(node, pages)

    # ---- residency (kept current in the eviction queues) --------------------------------
    def set_device(self, node: Node, pages: torch.Tensor) -> None:
        """Record ``pages`` as ``node``'s device copy (its parent must be device-resident)."""
        self.eviction.set_device(node, pages)

    def set_host(self, node: Node, pages: torch.Tensor) -> None:
        """Record ``pages`` as the host copy of ``node``, which has none."""
        self.eviction.set_host(node, pages)

    def drop_host(self, node: Node) -> torch.Tensor:
        """Forget ``node``'s host copy (it keeps a device copy); returns the pages to free."""
        return self.eviction.drop_host(node)

    def evict_device(
        self,
        num_pages: int,
        prepare: Callable[[Node], bool] | None = None,
        weight: Callable[[torch.Tensor], int] | None = None,
    ) -> Evicted:
        """Drop device copies of at least ``num_pages`` pages (fewer if not possible); see
        ``EvictionIndex.evict_device``."""
        return self.eviction.evict_device(num_pages, prepare, weight)

    def evict_host(
        self, num_pages: int, weight: Callable[[torch.Tensor], int] | None = None
    ) -> Evicted:
        """Drop host copies of at least ``num_pages`` pages (fewer if not possible)."""
        return self.eviction.evict_host(num_pages, weight)

    # ---- keys ---------------------------------------------------------------------------
    def ensure_keys(self, node: Node, namespace: Namespace) -> list[PageKey]:
        """Storage keys of ``node``'s pages (computing missing ones along the path)."""
        if node.keys is None:
            parent = node.parent
            prev = None
            if parent is not None and parent is not self.root:
                prev = self.ensure_keys(parent, namespace)[-1]
            node.keys = chain_keys(namespace, node.tokens, self.page_size, prev)
        return node.keys

    # ---- traversal and checks -----------------------------------------------------------
    def nodes(self) -> Iterator[Node]:
        """Every node except the root (pre-order)."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @staticmethod
    def subtree(node: Node) -> Iterator[Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def held_pages(self, tier: CopyTier) -> torch.Tensor:
        """All page ids the tree holds in ``tier``."""
        parts = [c for n in self.nodes() if (c := self._copy(n, tier)) is not None]
        return torch.cat(parts) if parts else _EMPTY

    def check_integrity(self) -> None:
        """Structure, residency and reference-count invariants; raises ``IntegrityError``."""
        ps = self.page_size
        for tier in ("device", "host"):
            held = self.held_pages(tier)
            if held.numel() != torch.unique(held).numel():
                raise IntegrityError(f"a {tier} page is held by two nodes")
        for n in self.nodes():
            ctx = f"node {n.id} at depth {n.depth_tokens()}"
            parent = n.parent
            if parent is None or parent.children.get(n.tokens[:ps]) is not n:
                raise IntegrityError(f"{ctx}: not linked from its parent")
            if not n.tokens or len(n.tokens) % ps:
                raise IntegrityError(f"{ctx}: {len(n.tokens)} tokens is not whole pages")
            if not (n.on_device or n.on_host):
                raise IntegrityError(f"{ctx}: no copy in any tier")
            for tier in ("device", "host"):
                c = self._copy(n, tier)
                if c is not None and c.numel() != n.num_pages(ps):
                    raise IntegrityError(f"{ctx}: {tier} copy has {c.numel()} pages")
            if n.ckpt is not None and n.ckpt.numel() != n.num_pages(ps):
                raise IntegrityError(f"{ctx}: {n.ckpt.numel()} checkpoint flags")
            if n.keys is not None and len(n.keys) != n.num_pages(ps):
                raise IntegrityError(f"{ctx}: {len(n.keys)} keys for {n.num_pages(ps)} pages")
            if n.on_device and parent is not self.root and not parent.on_device:
                raise IntegrityError(f"{ctx}: on device but its parent is not")
            if min(n.lock_ref, n.device_io, n.host_io) < 0:
                raise IntegrityError(f"{ctx}: negative reference count")
            if n.device_io and not n.on_device:
                raise IntegrityError(f"{ctx}: device I/O in flight without a device copy")
            if parent is not self.root and parent.lock_ref < n.lock_ref:
                raise IntegrityError(f"{ctx}: locked more than its parent")
        leaves = {
            n
            for n in self.nodes()
            if n.on_device and not any(c.on_device for c in n.children.values())
        }
        if leaves != self.eviction.device_leaves:
            raise IntegrityError(
                f"device leaf index out of date: {len(leaves ^ self.eviction.device_leaves)} nodes differ"
            )
        self.eviction.check(leaves)

"""Radix tree over pages.

The tree records which prefixes are cached and where (device/host page ids, storage flag). It
never allocates or frees memory: ``insert`` reports the caller's pages it did not take and
``evict_*`` report the pages they dropped; the caller returns them to the allocators.

Lock protocol: ``match`` is read-only and returns a ``TreeMatch``; the caller ``lock``s the match
before any other tree call (which may split the matched node so the lock covers exactly the
matched pages) and ``unlock``s it when done. A locked node keeps a usable copy in some tier.
Residency changes and eviction are in ``kvtier.tree.eviction``.

Partial tails: lookups of the children that hold a leaf's last, partial page. A partial tail is
a page with fewer than ``page_size`` valid tokens (the rest of the physical page is padding); it
is always the last page of a leaf. A node consisting of one partial page is keyed in its
parent's ``children`` by all its packed tokens (a key shorter than a page), so a whole-page
lookup never finds it; ``Node.tails`` counts such children so that nodes without any skip these
scans (``tail_child``, ``shorter_tail``).

Rules (``RadixTree.match`` / ``insert``)::

    request tokens vs a cached tail of r valid tokens    match        insert (device tier)
    equal on all r, and run on past them                 r tokens     replaces the tail *
    equal on all r, and end there                        r tokens     duplicate (freed)
    end inside the tail (fewer than r follow)            0 of it      new sibling tail
    diverge inside the tail                              0 of it      new sibling

    * the tail node is dropped with every copy (device, host) when unlocked and idle
      (no lock, no device or host I/O); otherwise it stays, a sibling of its longer version
      (keyed by fewer tokens, so a lookup running on past it finds the longer one), until
      eviction takes it. The same for host-tier inserts (storage fetches that run on past a
      cached tail: ``TieredCache.match`` fetches from the whole pages before it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from kvtier.errors import IntegrityError
from kvtier.keys import Namespace, PageKey, chain_keys
from kvtier.tree.checks import check_tree
from kvtier.tree.eviction import EvictionIndex, ResidencyListener
from kvtier.tree.eviction_order import EvictionPolicy, make_policy
from kvtier.tree.node import CopyTier, Node
from kvtier.tree.results import Evicted, InsertOutcome, TreeMatch, add_range
from kvtier.tree.token_arena import TokenArena
from kvtier.tree.tokens import (
    TOKEN_BYTES,
    Tokens,
    address,
    common_len,
    list_head,
    memequal,
    packed,
    unpack,
)

_EMPTY = torch.empty(0, dtype=torch.int64)

SplitHook = Callable[[Node, Node, int], None]
"""Called as ``hook(prefix, suffix, n_pages)`` after ``suffix`` lost its first pages to a new
parent ``prefix``; owners of in-flight work on ``suffix`` re-attribute it."""


def tail_child(node: Node, qm: memoryview, pos: int, page_size: int) -> Node | None:
    """The longest single-page partial-tail child of ``node`` whose tokens all equal the
    query's first ones from token ``pos`` on (``qm``: the query's packed bytes,
    ``kvtier.tree.tokens``), or ``None``."""
    if not node.tails:
        return None
    w = qm[pos * TOKEN_BYTES : (pos + page_size - 1) * TOKEN_BYTES].tobytes()
    get = node.children.get
    for end in range(len(w), 0, -TOKEN_BYTES):
        child = get(w[:end])
        if child is not None:
            return child
    return None


def shorter_tail(node: Node, key: bytes, page_size: int) -> Node | None:
    """The longest single-page partial-tail child of ``node`` whose tokens are a proper
    prefix of ``key`` (the packed next page, whole or partial, of an insert), or ``None``."""
    if not node.tails:
        return None
    get = node.children.get
    for end in range(min(len(key), page_size * TOKEN_BYTES) - TOKEN_BYTES, 0, -TOKEN_BYTES):
        child = get(key[:end])
        if child is not None:
            return child
    return None


class RadixTree:
    """Pages of ``page_size`` tokens; nodes split only on page boundaries. Lengths count
    valid tokens: a leaf's last page may be a partial tail (see the module docstring)."""

    def __init__(
        self, page_size: int, policy: EvictionPolicy | str = "lru", host_flags: bool = False
    ) -> None:
        """``host_flags``: ``Node.ckpt`` describes the host copy (a window pool, whose device
        arena knows its own rows) instead of every tier's copy (a state pool)."""
        self.page_size = page_size
        self.host_flags = host_flags
        self.policy = (
            make_policy(policy, page_size=page_size) if isinstance(policy, str) else policy
        )
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = Node(id=0, parent=None, buf=b"")
        self.split_hooks: list[SplitHook] = []
        self.eviction = EvictionIndex(self)
        """The eviction queues, told of every residency, lock and shape change."""
        self.arena = TokenArena()
        """Where long nodes keep their tokens (``kvtier.tree.token_arena``)."""

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: Tokens) -> TreeMatch:
        """Longest cached prefix of ``tokens`` (any container ``kvtier.tree.tokens`` accepts):
        whole pages, plus a partial tail only when all its valid tokens equal the next tokens
        (a request that diverges or ends inside a partial tail gets the whole pages before it).
        Never mutates."""
        head = list_head(tokens, self.page_size)
        if head is not None and not self.root.tails and head not in self.root.children:
            return TreeMatch([], 0, 0, 0, 0)
        qm = packed(tokens)
        ps, end = self.page_size, len(qm)
        page = ps * TOKEN_BYTES
        node, at, path, k, qaddr = self.root, 0, [], 0, 0
        device_len = host_len = 0
        while at < end:
            child = node.children.get(qm[at : at + page].tobytes()) if at + page <= end else None
            if child is None:
                child = tail_child(node, qm, at // TOKEN_BYTES, ps)
                if child is None:
                    break
            buf, size, addr = child.buf, len(child.buf), child.addr
            if addr:
                qaddr = qaddr or address(qm, tokens)
                full = end - at >= size and memequal(addr, qaddr + at, size)
            else:
                full = end - at >= size and buf.startswith(qm[at : at + size])
            if full:
                k = size // TOKEN_BYTES
            else:
                k = common_len(buf, qm, at // TOKEN_BYTES, ps, addr, qaddr, end - at >= size)
            path.append(child)
            if child.device is not None:
                device_len += k
            else:
                host_len += k
            at += k * TOKEN_BYTES
            if k * TOKEN_BYTES < size:
                break
            node = child
        last, tail = -(-k // ps), k % ps
        return TreeMatch(path, last, device_len, host_len, tail)

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
                self.policy.touch(n)
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
        tokens: Tokens,
        pages: torch.Tensor,
        tier: CopyTier = "device",
        keys: list[PageKey] | None = None,
        start: Node | None = None,
        checkpoints: torch.Tensor | None = None,
    ) -> InsertOutcome:
        """Record ``pages`` (one id per page of ``tokens``, the last one possibly partial) as
        copies in ``tier``.

        Existing nodes lacking a copy in ``tier`` adopt the caller's pages; pages of nodes that
        already have one are returned as duplicates. ``keys`` (one per page) marks the pages as
        present in storage too (used when they were fetched from L3). ``start`` (a locked node,
        default the root) is where ``tokens`` begin; ``cached_len`` is relative to it.
        ``checkpoints`` (bool per page, state models) says which pages' state rows are valid; a
        node adopting a copy keeps a checkpoint only where both copies have one.

        Partial tails (the module docstring): tokens that run on past a cached partial tail
        (a longer tail, or a whole page) replace it when the tail is unlocked and idle: its
        node is dropped with every copy (``dropped``, the caller frees them). Otherwise the
        tail stays beside the caller's longer pages, which the tree takes all the same.
        """
        ps = self.page_size
        tm = packed(tokens)
        n_bytes, page = len(tm), ps * TOKEN_BYTES
        n_tok = n_bytes // TOKEN_BYTES
        if pages.numel() != -(-n_tok // ps):
            raise IntegrityError(
                f"insert of {n_tok} tokens with {pages.numel()} pages (page_size={ps})"
            )
        node, pos, cached, prefix = start or self.root, 0, 0, True
        if n_tok and node.tail(ps):
            raise IntegrityError(f"insert below the partial tail of {node!r}")
        dups: list[tuple[int, int]] = []  # page ranges, contiguous ones merged
        taken: list[Node] = []
        dropped = Evicted()
        now = next(self._clock)
        qaddr, n_pages = 0, -(-n_tok // ps)
        dup_t: torch.Tensor | None = None
        while pos < n_tok:
            p0 = pos // ps
            key = tm[pos * TOKEN_BYTES : pos * TOKEN_BYTES + page].tobytes()
            child = node.children.get(key)
            if child is None:
                stale = shorter_tail(node, key, ps)
                if stale is not None:
                    # a busy tail stays beside its longer version (a later eviction takes it)
                    self._replace_tail(stale, tier, dropped)
                depth = node.depth + node.num_tokens
                child = Node(id=next(self._ids), parent=node, buf=b"", depth=depth)
                self.arena.store(child, tm[pos * TOKEN_BYTES :])
                node.children[key] = child
                node.tails += len(key) < page
                if dups == [(0, p0)]:  # the usual case: a cached prefix, then new pages
                    # one call for both parts (int page ids: the views need no autograd)
                    dup_t, rest = pages.unsafe_split_with_sizes((p0, n_pages - p0))
                    dups = []
                else:
                    rest = pages[p0:] if p0 else pages  # a view either way
                self._set_copy(child, tier, rest)
                if checkpoints is not None:
                    child.ckpt = checkpoints[p0:].clone()
                if keys is not None:
                    child.keys, child.in_storage = list(keys[p0:]), True
                    self.eviction.tell(child, "storage", True)
                child.last_access = now
                taken.append(child)
                node = child
                break
            buf, size, addr, at = child.buf, len(child.buf), child.addr, pos * TOKEN_BYTES
            fits = n_bytes - at >= size
            if addr:
                qaddr = qaddr or address(tm, tokens)
                full = fits and memequal(addr, qaddr + at, size)
            else:
                full = fits and buf.startswith(tm[at : at + size])
            if full:
                # tokens running on past a partial tail: whole pages here, the tail as a stale
                # sibling of the continuation next round (a whole-page key found the node)
                k = size // TOKEN_BYTES
                k -= k % ps if pos + k < n_tok else 0
            else:
                k = common_len(buf, tm, pos, ps, addr, qaddr, fits)
            n = -(-k // ps)
            if n * page < size:
                child = self._split(child, n)
            if self._copy(child, tier) is not None:
                add_range(dups, p0, p0 + n)
                if prefix:
                    cached = pos + k
            else:
                prefix = False
                self._set_copy(child, tier, pages[p0 : p0 + n])
                if checkpoints is not None and child.ckpt is not None:
                    child.ckpt = self._merge_flags(child.ckpt, checkpoints[p0 : p0 + n], tier)
                taken.append(child)
            if keys is not None and not child.in_storage:
                child.keys, child.in_storage = list(keys[p0 : p0 + n]), True
                self.eviction.tell(child, "storage", True)
            child.last_access = now
            self.policy.touch(child)
            pos += k
            node = child
        if dup_t is None:  # views of ``pages`` (the whole of it when every page was cached)
            parts = [pages if b - a == n_pages else pages[a:b] for a, b in dups]
            dup_t = (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else _EMPTY
        return InsertOutcome(cached, dup_t, taken, node, dropped)

    def _merge_flags(self, old: torch.Tensor, new: torch.Tensor, tier: CopyTier) -> torch.Tensor:
        """Flags of a node given a copy in ``tier`` next to the one it had. Flags of every
        tier: only what both copies have. Host flags: a host copy brings its own; a device
        copy leaves them alone (its rows are the arena's to know)."""
        if not self.host_flags:
            return old & new
        return new.clone() if tier == "host" else old

    def _replace_tail(self, stale: Node, tier: CopyTier, out: Evicted) -> bool:
        """Drop the partial tail ``stale`` that a longer version replaces, if allowed (see
        ``insert``); its pages go to ``out``. Returns whether it was dropped."""
        if stale.lock_ref or stale.device_io or stale.host_io:
            return False
        self.eviction.drop_leaf(stale, out)
        return True

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
        """Move the first ``n`` pages of ``node`` into a new parent; returns the new parent.
        Both parts keep the locks, I/O counts and copies (sliced); split hooks run last."""
        page = self.page_size * TOKEN_BYTES
        cut = n * page
        parent = node.parent
        if parent is None:
            raise IntegrityError(f"split of a node outside the tree: {node!r}")
        new = Node(
            id=next(self._ids), parent=parent, buf=node.buf[:cut], addr=node.addr, depth=node.depth
        )
        new.device = node.device[:n] if node.device is not None else None
        new.host = node.host[:n] if node.host is not None else None
        new.keys = node.keys[:n] if node.keys is not None else None
        new.ckpt = node.ckpt[:n] if node.ckpt is not None else None
        new.in_storage, new.origin = node.in_storage, node.origin
        self.eviction.hosted += new.host is not None
        new.lock_ref, new.device_io, new.host_io = node.lock_ref, node.device_io, node.host_io
        new.last_access, new.hits = node.last_access, node.hits
        new.device_credit, new.host_credit = node.device_credit, node.host_credit
        parent.children[bytes(node.buf[:page])] = new
        node.buf = node.buf[cut:]  # an arena run: a view of the same bytes, no copy
        node.depth += n * self.page_size
        node.addr += cut if node.addr else 0
        node.device = node.device[n:] if node.device is not None else None
        node.host = node.host[n:] if node.host is not None else None
        node.keys = node.keys[n:] if node.keys is not None else None
        node.ckpt = node.ckpt[n:] if node.ckpt is not None else None
        node.parent = new
        new.children[bytes(node.buf[:page])] = node
        new.tails = int(len(node.buf) < page)
        self.arena.adopt(new)
        self.eviction.refresh_leaf(new)
        if new.host is not None:
            self.eviction.queue_host(new)
        for hook in self.split_hooks:
            hook(new, node, n)
        return new

    def set_in_storage(self, node: Node, stored: bool) -> None:
        """Record whether storage holds every page object of ``node`` (``False``: rewrite)."""
        if node.in_storage != stored:
            node.in_storage = stored
            self.eviction.tell(node, "storage", stored)

    def set_origin(self, node: Node, origin: str | None) -> None:
        """Record the tier ``node``'s newest copy came from until an admission counts it."""
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
        part). Both parts share locks, I/O counts and copies; split hooks re-attribute work."""
        if not 0 < pages < node.num_pages(self.page_size):
            raise IntegrityError(f"split of {node!r} at page {pages}")
        return self._split(node, pages)

    def unpin_tail(self, node: Node) -> Node:
        """Move a request's lock off the partial tail ending at ``node`` (its lock node) once
        the request no longer reads it (it got a tail copy, or recomputes the tail): the tail
        becomes evictable and replaceable, so the request needs no page beyond its own. Splits
        a node that has whole pages before its tail. Returns the new lock node (the root when
        nothing is left). A tail still being loaded from host (``host_io``) keeps the lock: its
        device pages must not be reused under the copy."""
        ps = self.page_size
        if node is self.root or not node.tail(ps) or node.host_io:
            return node
        if node.num_pages(ps) > 1:
            self.split(node, node.num_pages(ps) - 1)
        parent = node.parent
        if parent is None:
            raise IntegrityError(f"unpin of a detached tail {node!r}")
        self.unlock(node)
        if parent is not self.root:
            self.lock_node(parent, hit=False)
        return parent

    # ---- residency (kept current in the eviction queues) --------------------------------
    def listen(self, listener: ResidencyListener | None) -> None:
        """Tell ``listener`` of every residency change from now on (one listener; ``None``
        stops): a copy made or dropped in the device or host tier, storage found to hold a
        node's objects or to have lost them (``ResidencyListener``)."""
        self.eviction.listener = listener

    def set_device(self, node: Node, pages: torch.Tensor) -> None:
        """Record ``pages`` as ``node``'s device copy (its parent must be device-resident)."""
        self.eviction.set_device(node, pages)

    def set_host(self, node: Node, pages: torch.Tensor, flags: torch.Tensor | None = None) -> None:
        """Record ``pages`` as the host copy of ``node``, which has none; ``flags`` (with
        ``host_flags``) become its ``Node.ckpt``: the pages of the copy holding window rows."""
        if flags is not None:
            if not self.host_flags or flags.numel() != pages.numel():
                raise IntegrityError(
                    f"{node!r}: {flags.numel()} host flags for {pages.numel()} pages"
                )
            node.ckpt = flags.clone()
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
            node.keys = chain_keys(namespace, unpack(node.buf), self.page_size, prev, tail=True)
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
        """Structure, residency, partial-tail and reference-count invariants; raises
        ``IntegrityError`` (``kvtier.tree.checks``)."""
        check_tree(self)

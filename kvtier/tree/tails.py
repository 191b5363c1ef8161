"""Partial tails: lookups of the children that hold a leaf's last, partial page.

A partial tail is a page with fewer than ``page_size`` valid tokens (the rest of the physical
page is padding); it is always the last page of a leaf. A node consisting of one partial page
is keyed in its parent's ``children`` by all its packed tokens (a key shorter than a page), so a
whole-page lookup never finds it; ``Node.tails`` counts such children so that nodes without
any skip these scans.

Rules (``RadixTree.match`` / ``insert``)::

    request tokens vs a cached tail of r valid tokens    match        insert (device tier)
    equal on all r, and run on past them                 r tokens     replaces the tail *
    equal on all r, and end there                        r tokens     duplicate (freed)
    end inside the tail (fewer than r follow)            0 of it      new sibling tail
    diverge inside the tail                              0 of it      new sibling

    * the tail node is dropped with every copy (device, host) when unlocked and idle
      (no lock, no device or host I/O); otherwise the caller's pages from that page on are
      duplicates. Host-tier inserts (storage fetches) never drop a tail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import IntegrityError
from kvtier.tree.node import Node
from kvtier.tree.tokens import TOKEN_BYTES

if TYPE_CHECKING:
    from kvtier.tree.radix import RadixTree


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


def unpin_tail(tree: RadixTree, node: Node) -> Node:
    """Move a request's lock off the partial tail ending at ``node`` (its lock node) once the
    request no longer reads it (it got a tail copy, or recomputes the tail): the tail becomes
    evictable and replaceable, so the request needs no page beyond its own. Splits a node that
    has whole pages before its tail. Returns the new lock node (the root when nothing is left).
    A tail still being loaded from host (``host_io``) keeps the lock: its device pages must
    not be reused under the copy."""
    ps = tree.page_size
    if node is tree.root or not node.tail(ps) or node.host_io:
        return node
    if node.num_pages(ps) > 1:
        tree.split(node, node.num_pages(ps) - 1)
    parent = node.parent
    if parent is None:
        raise IntegrityError(f"unpin of a detached tail {node!r}")
    tree.unlock(node)
    if parent is not tree.root:
        tree.lock_node(parent, hit=False)
    return parent

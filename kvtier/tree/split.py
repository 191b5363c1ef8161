"""Splitting a node in two on a page boundary (``RadixTree.split`` and the tree's own splits)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.errors import IntegrityError
from kvtier.tree.node import Node
from kvtier.tree.tokens import TOKEN_BYTES

if TYPE_CHECKING:
    from kvtier.tree.radix import RadixTree


def split_node(tree: RadixTree, node: Node, n: int) -> Node:
    """Move the first ``n`` pages of ``node`` into a new parent in ``tree``; returns the new
    parent. Both parts keep the locks, I/O counts and copies (sliced); split hooks run last."""
    page = tree.page_size * TOKEN_BYTES
    cut = n * page
    parent = node.parent
    if parent is None:
        raise IntegrityError(f"split of a node outside the tree: {node!r}")
    new = Node(id=next(tree._ids), parent=parent, buf=node.buf[:cut], addr=node.addr)
    new.device = node.device[:n] if node.device is not None else None
    new.host = node.host[:n] if node.host is not None else None
    new.keys = node.keys[:n] if node.keys is not None else None
    new.ckpt = node.ckpt[:n] if node.ckpt is not None else None
    new.in_storage, new.origin = node.in_storage, node.origin
    tree.eviction.hosted += new.host is not None
    new.lock_ref, new.device_io, new.host_io = node.lock_ref, node.device_io, node.host_io
    new.last_access, new.hits = node.last_access, node.hits
    parent.children[bytes(node.buf[:page])] = new
    node.buf = node.buf[cut:]  # an arena run: a view of the same bytes, no copy
    node.addr += cut if node.addr else 0
    node.device = node.device[n:] if node.device is not None else None
    node.host = node.host[n:] if node.host is not None else None
    node.keys = node.keys[n:] if node.keys is not None else None
    node.ckpt = node.ckpt[n:] if node.ckpt is not None else None
    node.parent = new
    new.children[bytes(node.buf[:page])] = node
    new.tails = int(len(node.buf) < page)
    tree.arena.adopt(new)
    tree.eviction.refresh_leaf(new)
    if new.host is not None:
        tree.eviction.queue_host(new)
    for hook in tree.split_hooks:
        hook(new, node, n)
    return new

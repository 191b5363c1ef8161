"""The radix tree's invariants, checked on demand (``RadixTree.check_integrity``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from kvtier.errors import IntegrityError
from kvtier.tree.eviction import EvictionIndex, IndexedTree
from kvtier.tree.tokens import TOKEN_BYTES

if TYPE_CHECKING:
    from kvtier.tree.node import CopyTier


class CheckedTree(IndexedTree, Protocol):
    """What the checks read of a tree (``RadixTree`` is one)."""

    eviction: EvictionIndex

    def held_pages(self, tier: CopyTier) -> torch.Tensor:
        """All page ids the tree holds in ``tier``."""
        ...


def check_tree(tree: CheckedTree) -> None:
    """Structure, residency, partial-tail and reference-count invariants of ``tree``; raises
    ``IntegrityError`` naming the node.

    Partial tails: a node whose last page holds fewer than ``page_size`` valid tokens has no
    children, is keyed in its parent by all its tokens when it is a single page, and its
    parent's ``tails`` counts it (every node's ``tails`` equals its partial-page children).
    """
    ps = tree.page_size
    page = ps * TOKEN_BYTES
    for tier in ("device", "host"):
        held = tree.held_pages(tier)
        if held.numel() != torch.unique(held).numel():
            raise IntegrityError(f"a {tier} page is held by two nodes")
    for n in (tree.root, *tree.nodes()):
        short = sum(len(k) < page for k in n.children)
        if short != n.tails:
            raise IntegrityError(f"node {n.id}: {short} partial-tail children, {n.tails} counted")
    for n in tree.nodes():
        ctx = f"node {n.id} at depth {n.depth_tokens()}"
        parent = n.parent
        if parent is None or parent.children.get(bytes(n.buf[:page])) is not n:
            raise IntegrityError(f"{ctx}: not linked from its parent")
        if n.depth != parent.depth + parent.num_tokens:
            raise IntegrityError(f"{ctx}: recorded depth {n.depth}")
        if not n.buf or len(n.buf) % TOKEN_BYTES:
            raise IntegrityError(f"{ctx}: {len(n.buf)} token bytes")
        if n.tail(ps) and n.children:
            raise IntegrityError(
                f"{ctx}: {len(n.children)} children below a partial tail of {n.tail(ps)} tokens"
            )
        if not (n.on_device or n.on_host):
            raise IntegrityError(f"{ctx}: no copy in any tier")
        pages = n.num_pages(ps)
        for tier in ("device", "host"):
            c = n.device if tier == "device" else n.host
            if c is not None and c.numel() != pages:
                raise IntegrityError(f"{ctx}: {tier} copy has {c.numel()} pages, not {pages}")
        if n.ckpt is not None and n.ckpt.numel() != pages:
            raise IntegrityError(f"{ctx}: {n.ckpt.numel()} checkpoint flags")
        if n.keys is not None and len(n.keys) != pages:
            raise IntegrityError(f"{ctx}: {len(n.keys)} keys for {pages} pages")
        if n.on_device and parent is not tree.root and not parent.on_device:
            raise IntegrityError(f"{ctx}: on device but its parent is not")
        if min(n.lock_ref, n.device_io, n.host_io) < 0:
            raise IntegrityError(f"{ctx}: negative reference count")
        if n.device_io and not n.on_device:
            raise IntegrityError(f"{ctx}: device I/O in flight without a device copy")
        if parent is not tree.root and parent.lock_ref < n.lock_ref:
            raise IntegrityError(f"{ctx}: locked more than its parent")
    leaves = {
        n for n in tree.nodes() if n.on_device and not any(c.on_device for c in n.children.values())
    }
    if leaves != tree.eviction.device_leaves:
        raise IntegrityError(
            f"device leaf index out of date: {len(leaves ^ tree.eviction.device_leaves)} nodes differ"
        )
    tree.eviction.check(leaves)
    tree.arena.check(list(tree.nodes()))

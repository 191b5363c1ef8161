"""Shared helpers for the radix tree tests: literal page ids, token pages, node lookup."""

from __future__ import annotations

import numpy as np
import torch

from kvtier.keys import namespace_digest
from kvtier.tree import Node, RadixTree

PS = 4
NS = namespace_digest(
    model_fingerprint="tiny",
    dtype="float32",
    page_size=PS,
    tree_page_size=PS,
    components=["kv"],
    rank=0,
    world_size=1,
)
"""A storage namespace for key tests."""


def P(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def L(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else t.tolist()


def page(v: int) -> list[int]:
    """One page of tokens all equal to ``v``."""
    return [v] * PS


def seq(*vals: int) -> list[int]:
    out: list[int] = []
    for v in vals:
        out += page(v)
    return out


def kids(node: Node) -> dict[tuple[int, ...], Node]:
    """``node.children`` with each packed key read back as a token tuple."""
    return {tuple(np.frombuffer(k, dtype=np.int32).tolist()): c for k, c in node.children.items()}


def flat(parts: list[torch.Tensor]) -> list[int]:
    return [p for t in parts for p in t.tolist()]


def snapshot(tree: RadixTree) -> list[tuple]:
    return sorted(
        (
            n.id,
            n.parent.id if n.parent is not None else None,
            n.tokens,
            L(n.device),
            L(n.host),
            n.lock_ref,
            n.device_io,
            n.host_io,
            n.last_access,
            n.hits,
        )
        for n in tree.nodes()
    )


def find(tree: RadixTree, tokens: list[int]) -> Node:
    """The node whose path from the root spells exactly ``tokens``."""
    for n in tree.nodes():
        parts, cur = [], n
        while cur is not None and cur is not tree.root:
            parts.append(cur.tokens)
            cur = cur.parent
        if tuple(t for p in reversed(parts) for t in p) == tuple(tokens):
            return n
    raise AssertionError(f"no node spelling {tokens}")

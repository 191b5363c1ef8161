"""Small result types the radix tree hands out (never tree internals beyond ``Node``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.tree.node import Node


@dataclass(slots=True)
class TreeMatch:
    """Read-only result of ``RadixTree.match``.

    ``path`` lists the matched nodes from the root down; only the last one may be matched
    partially (``last_pages`` of its pages). Tokens ``[0, device_len)`` are on device and
    ``[device_len, device_len + host_len)`` are on host only (valid tokens: when the match
    ends in a partial tail, ``tail`` is its valid tokens and the last of ``last_pages``).
    """

    path: list[Node]
    last_pages: int
    device_len: int
    host_len: int
    tail: int = 0

    @property
    def node(self) -> Node | None:
        return self.path[-1] if self.path else None

    @property
    def matched_len(self) -> int:
        return self.device_len + self.host_len


def truncate_match(m: TreeMatch, tokens: int, page_size: int) -> TreeMatch:
    """The part of ``m`` covering its first ``tokens`` tokens (a page multiple, or all of
    ``m`` when it ends in a partial tail)."""
    path, left, device_len, host_len, last, tail = [], tokens, 0, 0, 0, 0
    for i, node in enumerate(m.path):
        if left <= 0:
            break
        avail = node.num_tokens
        if i == len(m.path) - 1:
            avail = min(avail, m.last_pages * page_size - (page_size - m.tail) % page_size)
        take = min(avail, left)
        path.append(node)
        last, tail = -(-take // page_size), take % page_size
        if node.on_device:
            device_len += take
        else:
            host_len += take
        left -= take
    return TreeMatch(path, last, device_len, host_len, tail)


@dataclass(slots=True)
class InsertOutcome:
    """What ``insert`` did with the caller's pages.

    ``cached_len``: tokens (a prefix) that already had a copy in the target tier.
    ``duplicates``: the caller's page ids the tree did not take; the caller frees them.
    ``taken``: nodes that received the caller's pages (new or adopted), in path order.
    ``dropped``: see the field.
    """

    cached_len: int
    duplicates: torch.Tensor
    taken: list[Node]
    last: Node
    dropped: Evicted = field(default_factory=lambda: Evicted())
    """Partial tails a longer version replaced, with their pages; the caller frees them."""


@dataclass(slots=True)
class Evicted:
    """Pages dropped by an eviction, to be returned to their allocators."""

    device_pages: list[torch.Tensor] = field(default_factory=list)
    host_pages: list[torch.Tensor] = field(default_factory=list)
    removed_nodes: int = 0

    def num_device(self) -> int:
        return sum(p.numel() for p in self.device_pages)

    def num_host(self) -> int:
        return sum(p.numel() for p in self.host_pages)


def add_range(ranges: list[tuple[int, int]], a: int, b: int) -> None:
    """Append the page range ``[a, b)`` to ``ranges``, merged into the last one if adjacent."""
    if ranges and ranges[-1][1] == a:
        ranges[-1] = (ranges[-1][0], b)
    else:
        ranges.append((a, b))

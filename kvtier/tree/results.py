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
    ``[device_len, device_len + host_len)`` are on host only.
    """

    path: list[Node]
    last_pages: int
    device_len: int
    host_len: int

    @property
    def node(self) -> Node | None:
        return self.path[-1] if self.path else None

    @property
    def matched_len(self) -> int:
        return self.device_len + self.host_len


def truncate_match(m: TreeMatch, tokens: int, page_size: int) -> TreeMatch:
    """The part of ``m`` covering its first ``tokens`` tokens (a page multiple)."""
    path, left, device_len, host_len, last = [], tokens, 0, 0, 0
    for i, node in enumerate(m.path):
        if left <= 0:
            break
        avail = (m.last_pages if i == len(m.path) - 1 else node.num_pages(page_size)) * page_size
        take = min(avail, left)
        path.append(node)
        last = take // page_size
        if node.on_device:
            device_len += take
        else:
            host_len += take
        left -= take
    return TreeMatch(path=path, last_pages=last, device_len=device_len, host_len=host_len)


@dataclass(slots=True)
class InsertOutcome:
    """What ``insert`` did with the caller's pages.

    ``cached_len``: tokens (a prefix) that already had a copy in the target tier.
    ``duplicates``: the caller's page ids the tree did not take; the caller frees them.
    ``taken``: nodes that received the caller's pages (new or adopted), in path order.
    """

    cached_len: int
    duplicates: torch.Tensor
    taken: list[Node]
    last: Node


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

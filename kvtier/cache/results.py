"""Result types at the cache's boundary: what ``match`` and ``load`` return, and the handle
the lock protocol passes around."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.keys import PageKey
from kvtier.tree.node import Node
from kvtier.tree.results import TreeMatch


@dataclass(slots=True, eq=False)
class Handle:
    """Opaque token for one match; pass it to ``lock``/``unlock``/``finish``.

    ``match`` is the whole tree match (a prefetch continues after its end); ``usable`` the
    resumable part of it that ``lock`` pins and ``load`` returns.
    """

    match: TreeMatch
    usable: int
    tokens: tuple[int, ...]
    storage_keys: list[PageKey]
    node: Node | None = None
    locked: TreeMatch | None = None
    load_result: LoadResult | None = None
    """What ``load`` returned while locked: ``record_hits`` counts it, ``finish`` checks the
    engine hands its slots back."""
    moved_nodes: list[Node] = field(default_factory=list)
    """Nodes whose copies were moved up for this request (``Node.origin``), not yet counted."""
    tail_copy: int | None = None
    """The engine page holding the copy of a partial tail the last ``load`` served (see
    ``kvtier.cache``), until ``finish`` or ``unlock``."""


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Where the longest cached prefix of a request lives (valid token counts: whole pages,
    plus a partial tail when the request runs on past all its tokens)."""

    device_len: int
    """Tokens ``[0, device_len)`` are in the device tier."""
    host_len: int
    """Tokens after those that are in the host tier."""
    storage_len: int
    """Tokens after those that are in storage (need a prefetch)."""
    handle: Handle

    @property
    def cached_len(self) -> int:
        """Tokens usable after ``load`` without a prefetch."""
        return self.device_len + self.host_len


@dataclass(frozen=True, slots=True)
class LoadResult:
    """The device slots of a locked prefix (one per valid token; a served partial tail's slots
    are a tail copy's, see ``kvtier.cache``), and where its tokens came from."""

    locs: torch.Tensor
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    layer_events: list | None = None
    """With ``load(..., overlap=True)`` on CUDA: ``torch.cuda.Event`` per anchor layer; wait
    on event ``i`` before reading anchor layer ``i`` (earlier components arrive with layer 0).
    ``None``: the data is there for every kernel issued after ``load``."""
    state_source: str | None = None
    """Tier the last loaded node came from (``device``/``host``/``storage``): where a state
    pool's resume row came from. ``None`` when nothing was cached."""


@dataclass(frozen=True, slots=True)
class InsertResult:
    cached_len: int
    """Tokens (a prefix) whose device pages already existed: the caller's pages there are
    duplicates (except those it got from ``load``)."""

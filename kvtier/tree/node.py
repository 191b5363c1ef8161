"""Tree node: a run of pages and where copies of them live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.keys import PageKey
from kvtier.tree.tokens import TOKEN_BYTES, to_tuple

CopyTier = Literal["device", "host"]
"""The tiers that hold page copies a node records (storage holds objects, by key)."""


@dataclass(slots=True, eq=False)
class Node:
    """A run of pages sharing one residency.

    ``buf`` holds the node's valid tokens packed as int32 bytes (``kvtier.tree.tokens``): a
    ``bytes`` object, or for a long run a view of the tree's token arena (``addr``);
    ``tokens`` is the same as a tuple of ints. Every page is whole except, possibly, the last
    page of a leaf (a *partial tail*, ``tail(page_size) > 0`` valid tokens in a whole physical
    page whose other slots are padding). Nothing hangs below a partial page. ``children`` are
    keyed by the bytes of their first page; ``tails`` counts the children that are partial
    tails (a partial tail child is keyed by all its tokens, fewer than a page).

    Residency is per node: ``device``/``host`` hold one page id per page of the node or are
    ``None``. Every node except the root has at least one of them. Device residency is closed
    under prefixes (a device-resident node's parent is device-resident).

    Reference counts:
      ``lock_ref``   requests using this node or a descendant; no tier drops the only usable
                     copy while it is positive.
      ``device_io``  in-flight transfers reading the device copy (backups).
      ``host_io``    in-flight transfers reading or writing the host copy.

    ``ckpt`` (models with a state pool only) flags, per page, whether the page's state row holds
    a valid checkpoint of the state after the page's last token, in every tier that has a copy.

    ``origin`` is the tier a copy came from that no counted admission has used yet
    (``storage`` for a fetched host copy, ``host`` for a device copy loaded from host), so the
    request it was moved for counts it as a hit of that tier even if its admission was retried.
    """

    id: int
    parent: Node | None
    buf: bytes | memoryview
    children: dict[bytes, Node] = field(default_factory=dict)
    device: torch.Tensor | None = None
    host: torch.Tensor | None = None
    keys: list[PageKey] | None = None
    ckpt: torch.Tensor | None = None
    in_storage: bool = False
    origin: str | None = None
    lock_ref: int = 0
    device_io: int = 0
    host_io: int = 0
    last_access: int = 0
    hits: int = 0
    tails: int = 0
    depth: int = 0
    """Tokens before the node's first token (from the root); the tree keeps it as nodes split."""
    device_credit: float = 0.0
    """Eviction credit of the device copy (``eviction_policy='cost'``,
    ``kvtier.tree.eviction_order``)."""
    host_credit: float = 0.0
    """Eviction credit of the host copy (likewise)."""
    addr: int = 0
    """Address of ``buf``'s first byte when ``buf`` is a run in the tree's token arena (a
    read-only ``memoryview``, ``kvtier.tree.token_arena``); 0 when ``buf`` is ``bytes``."""

    @property
    def num_tokens(self) -> int:
        """Valid tokens of the node."""
        return len(self.buf) // TOKEN_BYTES

    @property
    def tokens(self) -> tuple[int, ...]:
        """The node's tokens as ints (a fresh tuple each call: for inspection only)."""
        return to_tuple(self.buf)

    def num_pages(self, page_size: int) -> int:
        """Physical pages of the node (a partial tail counts as one)."""
        return -(-(len(self.buf) // TOKEN_BYTES) // page_size)

    def tail(self, page_size: int) -> int:
        """Valid tokens of the last page when it is partial, else 0."""
        return (len(self.buf) // TOKEN_BYTES) % page_size

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def depth_tokens(self) -> int:
        """Tokens from the root to the end of this node."""
        n, node = 0, self
        while node is not None:
            n += len(node.buf)
            node = node.parent
        return n // TOKEN_BYTES

    def __repr__(self) -> str:
        return (
            f"Node(id={self.id}, tokens={self.num_tokens}, device={self.on_device}, "
            f"host={self.on_host}, storage={self.in_storage}, lock={self.lock_ref})"
        )

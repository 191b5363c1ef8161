"""Component-aware hit lengths: how much of a matched prefix a request can actually resume from.

A prefix is usable at a tier only up to the deepest point where every component needed to
resume is present there. KV and sidecars always travel together (one storage object per page),
so for them that is the matched length. A model with a state pool additionally needs a valid
checkpoint at the resume point: the usable length is the deepest page boundary, within the
matched length, whose page carries one — an earlier checkpoint rather than no hit at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import IntegrityError
from kvtier.keys import Namespace, PageKey, chain_keys, state_key, tail_key
from kvtier.paging import pages_to_locs
from kvtier.storage.base import StorageBackend
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree
from kvtier.tree.results import TreeMatch
from kvtier.types import Tier, check_tier


def checkpointed_len(m: TreeMatch, limit: int, page_size: int) -> int:
    """Deepest page boundary ``<= limit`` tokens along ``m`` whose page has a valid checkpoint
    (``0`` if none)."""
    best, pos = 0, 0
    for i, node in enumerate(m.path):
        pages = m.last_pages if i == len(m.path) - 1 else node.num_pages(page_size)
        pages = min(pages, (limit - pos) // page_size)
        if pages <= 0:
            break
        if node.ckpt is not None:
            valid = node.ckpt[:pages].nonzero()
            if valid.numel():
                best = pos + (int(valid[-1]) + 1) * page_size
        pos += pages * page_size
    return best


def usable_lengths(m: TreeMatch, stateful: bool, page_size: int) -> tuple[int, int]:
    """``(device_len, usable_len)``: resumable tokens on device alone and on device + host."""
    if not stateful:
        return m.device_len, m.matched_len
    return (
        checkpointed_len(m, m.device_len, page_size),
        checkpointed_len(m, m.matched_len, page_size),
    )


def storage_extension(
    backend: StorageBackend,
    tree: RadixTree,
    namespace: Namespace,
    m: TreeMatch,
    tokens: Sequence[int],
    page_size: int,
    stateful: bool,
    exists: Callable[[list[PageKey], int], int] | None = None,
    tails: bool = False,
) -> tuple[list[PageKey], int]:
    """Keys of the pages after the tree match that storage holds and a request could resume
    after: a prefix of present page objects, cut (state models) after the deepest page whose
    checkpoint object is present too. ``exists(keys, first_page)`` counts the leading keys
    present, ``first_page`` being the sequence page of ``keys[0]`` (default: the backend's
    ``batch_exists``; a CP rank asks only about the pages it owns).

    With ``tails`` (not for state models) a partial tail object may end the run: when
    something is cached before it (tree or storage) and the tokens run on past the whole
    pages found, the longest stored tail of the next ``page_size - 1`` tokens is looked up,
    one existence check per candidate length, longest first. Returns ``(keys, tail)``,
    ``tail`` being the valid tokens of the last key's page when it is a tail (else 0)."""
    start = m.matched_len
    if m.tail:
        return [], 0  # nothing hangs below a partial tail
    prev = None
    if m.path:
        prev = tree.ensure_keys(m.path[-1], namespace)[m.last_pages - 1]
    found: list[PageKey] = []
    chunk, pos = 8, start
    # Keys are computed in growing chunks: a miss early on costs a few hashes, not the prompt.
    while pos + page_size <= len(tokens):
        cand = chain_keys(namespace, tokens[pos : pos + chunk * page_size], page_size, prev)
        k = exists(cand, pos // page_size) if exists else backend.batch_exists(cand)
        found += cand[:k]
        if k < len(cand):
            break
        pos, prev, chunk = pos + k * page_size, cand[-1], chunk * 4
    if stateful:
        while found and backend.batch_exists([state_key(found[-1])]) == 0:
            found.pop()
        return found, 0
    pos = start + len(found) * page_size
    if not tails or not (found or start) or pos >= len(tokens):
        return found, 0
    last = found[-1] if found else prev
    rest = tokens[pos : pos + page_size - 1]
    for r in range(len(rest), 0, -1):
        key = tail_key(namespace, rest[:r], last)
        if (exists([key], pos // page_size) if exists else backend.batch_exists([key])) == 1:
            return [*found, key], r
    return found, 0


@dataclass(frozen=True, slots=True)
class Served:
    """Where the first ``usable`` tokens of a loaded path came from."""

    locs: torch.Tensor
    """Their device slots."""
    tokens: tuple[int, int, int]
    """Tokens served from device, host and storage."""
    last: Tier | None
    """The tier of the last node used (a state pool's resume row), ``None`` if none."""
    moved: list[Node]
    """Nodes whose copies were moved up for this request (their ``origin`` is set)."""


def served_prefix(
    path: list[Node], was_on_device: list[bool], usable: int, page_size: int
) -> Served:
    """Attribute the first ``usable`` tokens of the loaded ``path`` to tiers. A node moved up
    for a request (``Node.origin``) counts as a hit of the tier it came from until an
    admission was counted on it: a load whose admission failed and was retried leaves it on
    device, yet the request was served from below."""
    counts: dict[Tier, int] = {"device": 0, "host": 0, "storage": 0}
    pages: list[torch.Tensor] = []
    moved: list[Node] = []
    left: int = usable
    last: Tier | None = None
    for node, was_dev in zip(path, was_on_device, strict=True):
        if left <= 0:
            break
        take = min(len(node.tokens), left)
        last = (
            check_tier(node.origin, "Node.origin")
            if node.origin
            else ("device" if was_dev else "host")
        )
        counts[last] += take
        if node.origin is not None:
            moved.append(node)
        if node.device is None:
            raise IntegrityError(f"node {node.id}: loaded but has no device copy")
        pages.append(node.device[: -(-take // page_size)])
        left -= take
    locs = (
        pages_to_locs(torch.cat(pages), page_size)[:usable]
        if pages
        else torch.empty(0, dtype=torch.int64)
    )
    return Served(locs, (counts["device"], counts["host"], counts["storage"]), last, moved)

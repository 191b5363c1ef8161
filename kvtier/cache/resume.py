"""Component-aware hit lengths: how much of a matched prefix a request can actually resume from.

A prefix is usable at a tier only up to the deepest point where every component needed to
resume is present there. KV and sidecars always travel together (one storage object per page),
so for them that is the matched length. A *partial* component (``PoolSpec.partial``, flagged
per page by ``Node.ckpt``) narrows it to the deepest page boundary ``b`` within the matched
length whose flags say the component is there where resuming at ``b`` reads it — an earlier
resume point rather than no hit at all:

    state pool     the page ending at ``b`` carries a checkpoint
    window pool    every page holding a token in ``[b - window + 1, b)`` carries window rows
                   (the first query, at ``b``, reads ``(b - window, b]``)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.errors import IntegrityError
from kvtier.keys import Namespace, PageKey, chain_keys, state_key, tail_key
from kvtier.paging import pages_to_locs
from kvtier.pools.spec import PoolSpec
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


DeviceFlags = Callable[[torch.Tensor], torch.Tensor]
"""Which of some device pages hold the partial component now (a window pool's arena)."""


def path_flags(
    m: TreeMatch, limit: int, page_size: int, on_device: DeviceFlags | None = None
) -> torch.Tensor:
    """Per whole page of ``m`` within ``limit`` tokens, in order, whether the partial
    component is there where the page would be read from: ``on_device`` of a device copy when
    given, else the node's ``Node.ckpt`` (false where a node has none)."""
    flags, pos = [], 0
    for i, node in enumerate(m.path):
        pages = m.last_pages if i == len(m.path) - 1 else node.num_pages(page_size)
        pages = min(pages, (limit - pos) // page_size)
        if pages <= 0:
            break
        if on_device is not None and node.device is not None:
            flags.append(on_device(node.device[:pages]))
        elif node.ckpt is None:
            flags.append(torch.zeros(pages, dtype=torch.bool))
        else:
            flags.append(node.ckpt[:pages])
        pos += pages * page_size
    return torch.cat(flags) if flags else torch.zeros(0, dtype=torch.bool)


def window_pages(boundary_page: int, page_size: int, window: int) -> int:
    """Pages before page boundary ``boundary_page`` that resuming there reads (window pool)."""
    first_token = max(0, boundary_page * page_size - window + 1)
    return boundary_page - first_token // page_size


def windowed_pages(flags: torch.Tensor, page_size: int, window: int) -> int:
    """Deepest page boundary ``k <= len(flags)`` such that the window before it is flagged
    (``0`` when none is: resuming at 0 reads nothing)."""
    n = flags.numel()
    if n == 0:
        return 0
    # boundary k reads pages [first(k), k); they are all flagged iff no gap falls in them
    gaps = torch.zeros(n + 1, dtype=torch.int64)
    gaps[1:] = torch.cumsum(~flags.to(torch.bool), 0)
    k = torch.arange(1, n + 1)
    first = (k * page_size - window + 1).clamp(min=0) // page_size
    ok = (gaps[k] - gaps[first]) == 0
    hit = torch.nonzero(ok).reshape(-1)
    return int(k[hit[-1]]) if hit.numel() else 0


def windowed_len(
    m: TreeMatch, limit: int, page_size: int, window: int, on_device: DeviceFlags | None = None
) -> int:
    """Deepest page boundary ``<= limit`` tokens along ``m`` that a window pool of ``window``
    positions can resume from (module docstring)."""
    flags = path_flags(m, limit, page_size, on_device)
    return windowed_pages(flags, page_size, window) * page_size


@dataclass(frozen=True, slots=True)
class Resume:
    """What resuming a cached prefix needs besides the KV pages (module docstring)."""

    state: bool = False
    """A state pool: a checkpoint at the resume point."""
    window: int = 0
    """A window pool of this many positions (``0``: none)."""

    @classmethod
    def of(cls, specs: Sequence[PoolSpec]) -> Resume:
        return cls(
            state=any(s.kind == "state" for s in specs),
            window=max((s.window for s in specs if s.kind == "window"), default=0),
        )

    @property
    def partial(self) -> bool:
        """Some component is present on some pages only (``Node.ckpt`` is kept)."""
        return self.state or self.window > 0

    def cut(
        self, m: TreeMatch, limit: int, page_size: int, on_device: DeviceFlags | None = None
    ) -> int:
        """Deepest resumable point of ``m`` within ``limit`` tokens (``on_device``: where a
        window pool's device pages have their rows, see ``path_flags``)."""
        if self.state:
            return checkpointed_len(m, limit, page_size)
        if self.window:
            return windowed_len(m, limit, page_size, self.window, on_device)
        return limit


def usable_lengths(
    m: TreeMatch, resume: Resume, page_size: int, on_device: DeviceFlags | None = None
) -> tuple[int, int]:
    """``(device_len, usable_len)``: resumable tokens on device alone and on device + host."""
    if not resume.partial:
        return m.device_len, m.matched_len
    return (
        resume.cut(m, m.device_len, page_size, on_device),
        resume.cut(m, m.matched_len, page_size, on_device),
    )


def run_tokens(keys: Sequence[PageKey], tail: int, page_size: int) -> int:
    """Tokens a storage run covers: ``keys``' pages, the last holding ``tail`` valid tokens
    when that is not 0 (``storage_extension``'s result)."""
    return len(keys) * page_size - (page_size - tail) % page_size if keys else 0


def storage_extension(
    backend: StorageBackend,
    tree: RadixTree,
    namespace: Namespace,
    m: TreeMatch,
    tokens: Sequence[int],
    page_size: int,
    resume: Resume,
    exists: Callable[[list[PageKey], int], int] | None = None,
    tails: bool = False,
    on_device: DeviceFlags | None = None,
    agree: Callable[[int], int] | None = None,
) -> tuple[list[PageKey], int]:
    """Keys of the pages after the tree match that storage holds and a request could resume
    after: a prefix of present page objects, cut (``resume.partial``) at the deepest resume
    point whose partial-component objects (``state_key``) are present where it needs them. ``exists(keys, first_page)`` counts the leading keys
    present, ``first_page`` being the sequence page of ``keys[0]`` (default: the backend's
    ``batch_exists``; a CP rank asks only about the pages it owns).

    With ``tails`` (not for state models) a partial tail object may end the run: when
    something is cached before it (tree or storage) and the tokens run on past the whole
    pages found, the longest stored tail of the next ``page_size - 1`` tokens is looked up,
    one existence check per candidate length, longest first. Returns ``(keys, tail)``,
    ``tail`` being the valid tokens of the last key's page when it is a tail (else 0).

    ``agree`` (a CP group's MIN over ranks) makes every rank return the same run. Each rank
    found what it could tell of the pages it owns (a page owned elsewhere counts as present,
    so a rank that does not own the tail page takes its longest candidate); the MIN of the
    tokens found is the run every owner found, whole pages and tail alike."""
    start = m.matched_len
    if m.tail:
        # nothing hangs below a partial tail (``TieredCache.match`` asks from the whole pages
        # before it)
        return [], 0
    prev = None
    if m.path:
        prev = tree.ensure_keys(m.path[-1], namespace)[m.last_pages - 1]
    found, tail = _stored_run(
        backend, m, tokens, namespace, prev, page_size, resume, exists, tails, on_device
    )
    if agree is None:
        return found, tail
    whole = len(found) - (1 if tail else 0)
    got = agree(whole * page_size + tail)
    whole, tail = divmod(got, page_size)
    found = found[:whole]  # every rank found at least ``whole`` whole pages
    if tail:
        last = found[-1] if found else prev
        pos = start + whole * page_size
        found.append(tail_key(namespace, tokens[pos : pos + tail], last))
    return found, tail


def _stored_run(
    backend: StorageBackend,
    m: TreeMatch,
    tokens: Sequence[int],
    namespace: Namespace,
    prev: PageKey | None,
    page_size: int,
    resume: Resume,
    exists: Callable[[list[PageKey], int], int] | None,
    tails: bool,
    on_device: DeviceFlags | None,
) -> tuple[list[PageKey], int]:
    """``storage_extension`` as far as this rank can tell (no agreement over ranks)."""
    start = m.matched_len
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
    if resume.state:
        while found and backend.batch_exists([state_key(found[-1])]) == 0:
            found.pop()
        return found, 0
    if resume.window:
        return _windowed(backend, m, found, page_size, resume.window, on_device), 0
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


def _windowed(
    backend: StorageBackend,
    m: TreeMatch,
    found: list[PageKey],
    page_size: int,
    window: int,
    on_device: DeviceFlags | None,
) -> list[PageKey]:
    """``found`` cut at the deepest resume point whose window is flagged in the tree or has
    its window objects in storage. Only the last pages a window can reach are probed: a
    resume point further back would need pages the probe skipped, which count as absent."""
    if not found:
        return found
    reach = min(len(found), -(-(window - 1) // page_size))  # pages one window spans
    probed = [backend.batch_exists([state_key(k)]) == 1 for k in found[-reach:]]
    tree = path_flags(m, m.matched_len, page_size, on_device)
    flags = torch.cat(
        [
            tree,
            torch.zeros(len(found) - reach, dtype=torch.bool),
            torch.tensor(probed, dtype=torch.bool),
        ]
    )
    k = windowed_pages(flags, page_size, window) - tree.numel()
    return found[: max(k, 0)]


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
        take = min(node.num_tokens, left)
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

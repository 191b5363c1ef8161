"""Result types at the cache's boundary: what ``match``, ``load`` and ``admit`` return, and
the handle the lock protocol passes around."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.controller.records import PrefetchOp
from kvtier.errors import RequestError
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


@dataclass(slots=True, eq=False)
class Admission:
    """One request on its way into the cache (``TieredCache.admit``): *pending* while the
    storage prefetch it waits for under the prefetch policy runs, then *ready*: its prefix is
    locked and loaded, and the fields below say what the engine has to compute. Once *done*
    (``finish`` with its handle, or ``abandon``) it is only a record.

    Reading a ready admission's fields while it is pending raises ``RequestError``: what a
    prefix will be served from is not known before its fetch ended.
    """

    tokens: tuple[int, ...]
    """The tokens ``admit`` was given."""
    overlap: bool
    """``load(..., overlap=)`` of the admission."""
    prefetch: PrefetchOp | None = None
    """The fetch a pending admission waits for (``None`` once consumed)."""
    match: MatchResult | None = None
    """The match it locked (ready)."""
    load_result: LoadResult | None = None
    """What ``load`` returned for it (ready)."""
    abandoned: bool = False

    @property
    def pending(self) -> bool:
        """Waiting for its storage prefetch: ``TieredCache.admit_ready`` makes it ready."""
        return self.load_result is None and not self.abandoned

    @property
    def ready(self) -> bool:
        """Locked and loaded: the engine allocates ``num_new`` tokens and computes them."""
        return self.load_result is not None and not self.done

    @property
    def done(self) -> bool:
        """Abandoned, or its handle was finished (or unlocked) since."""
        return self.abandoned or (self.match is not None and self.match.handle.node is None)

    def _loaded(self, what: str) -> LoadResult:
        if self.load_result is None:
            state = "abandoned" if self.abandoned else "pending (its storage prefetch runs)"
            raise RequestError(
                f"Admission.{what}: the admission is {state}; it has {what} once "
                "cache.admit_ready(adm) returned True"
            )
        return self.load_result

    @property
    def handle(self) -> Handle:
        """The locked handle: pass it to ``record_hits`` and ``finish``."""
        self._loaded("handle")
        return self.match.handle  # type: ignore[union-attr]  # set with load_result

    @property
    def locs(self) -> torch.Tensor:
        """Device slots of the cached prefix (``LoadResult.locs``)."""
        return self._loaded("locs").locs

    @property
    def cached_len(self) -> int:
        """Tokens served from the cache: ``finish``'s ``prefix_len``, ``alloc``'s ``at``."""
        return int(self._loaded("cached_len").locs.numel())

    @property
    def num_new(self) -> int:
        """Tokens the engine computes (``len(tokens) - cached_len``)."""
        return len(self.tokens) - self.cached_len

    @property
    def device_tokens(self) -> int:
        """Of the cached prefix: tokens that were in the device tier already."""
        return self._loaded("device_tokens").device_tokens

    @property
    def host_tokens(self) -> int:
        """Of the cached prefix: tokens loaded from the host tier."""
        return self._loaded("host_tokens").host_tokens

    @property
    def storage_tokens(self) -> int:
        """Of the cached prefix: tokens restored from storage (by this or an earlier fetch)."""
        return self._loaded("storage_tokens").storage_tokens

    @property
    def layer_events(self) -> list | None:
        """``LoadResult.layer_events`` (with ``overlap=True`` on CUDA)."""
        return self._loaded("layer_events").layer_events

"""Typed records of in-flight work, and the one place a node split re-attributes them.

Every in-flight operation lists the nodes it covers as ``Span``s. When the tree splits a node
the operation covers, the new parent shares the node's I/O counts (``RadixTree.split``), so it
needs a span of its own: ``split_spans`` gives it the head of the span's part.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from kvtier.keys import PageKey
from kvtier.parallel.group import Group, SoloGroup
from kvtier.transfer.op import TransferOp
from kvtier.tree.node import Node

T = TypeVar("T")


def finished(items: Sequence[T], done: Callable[[T], bool], group: Group) -> list[T]:
    """The in-flight ``items`` (oldest first) to complete now.

    Alone, every one that is ``done``. In a CP group, completion must become visible on every
    rank at once (contracts 3 and 4): each rank counts its *leading* done items and the group
    takes the minimum, so the same items complete everywhere, in issue order, and an item
    completes only once every rank finished its shard of it (a rank with nothing to move for
    it was done at once: a zero-owned acknowledgement).
    """
    if group.size == 1:
        return [x for x in items if done(x)]
    local = 0
    for x in items:
        if not done(x):
            break
        local += 1
    return list(items[: group.all_reduce_min(local)])


def agree_all(flags: list[bool], group: Group) -> list[bool]:
    """Each flag true only where it is true on every rank (itself without a CP group)."""
    if group.size == 1 or not flags:
        return flags
    return [v == 1 for v in group.all_reduce_min_many([1 if f else 0 for f in flags])]


@dataclass(slots=True, eq=False)
class Span:
    """The part of ``node`` an operation covers: its slice of the operation's host pages (a
    tensor), of its keys (a range), or ``None`` when the operation only pins the node."""

    node: Node
    part: torch.Tensor | range | None = None


def split_spans(spans: list[Span], prefix: Node, suffix: Node, n: int) -> None:
    """``suffix`` lost its first ``n`` pages to the new parent ``prefix``: every span of
    ``suffix`` keeps the tail of its part and ``prefix`` gets a span with the head."""
    for span in [s for s in spans if s.node is suffix]:
        head = span.part[:n] if span.part is not None else None
        span.part = span.part[n:] if span.part is not None else None
        spans.append(Span(prefix, head))


@dataclass(slots=True, eq=False)
class InFlight:
    """A device ↔ host copy in flight. ``tier`` is the copy it pins on every spanned node:
    ``device`` for a backup (it reads the device copy), ``host`` for a load."""

    op: TransferOp  # or ``layered.Joined``: several per-layer copies of one node
    spans: list[Span]
    tier: Literal["device", "host"]
    started: float = field(default_factory=time.perf_counter)
    pages: int | None = None
    """Pages this flight moves on this rank when its op is shared with other flights (a
    per-layer backup); ``None``: all of ``op``'s."""


class Flights:
    """Device ↔ host copies of one kind in flight, oldest first (``Backups`` and ``Loads``)."""

    def __init__(self, group: Group | None = None) -> None:
        self.flights: list[InFlight] = []
        self.group: Group = group or SoloGroup()

    def finished(self) -> list[InFlight]:
        """The copies to complete at this poll (see :func:`finished`)."""
        return finished(self.flights, lambda f: f.op.done(), self.group)

    def wait(self) -> None:
        """Block until every copy in flight completed (a poll makes it visible)."""
        for flight in list(self.flights):
            flight.op.wait()

    def on_split(self, prefix: Node, suffix: Node, n: int) -> None:
        for flight in self.flights:
            split_spans(flight.spans, prefix, suffix, n)

    def pinned(self) -> list[tuple[Node, str]]:
        """``(node, tier)`` once for every pin the copies in flight hold."""
        return [(sp.node, f.tier) for f in self.flights for sp in f.spans]


@dataclass(slots=True, eq=False)
class PrefetchOp:
    """Storage → host fetch of ``keys`` into ``pages``.

    ``prefix`` holds the tokens before the fetched range (from the root), ``tokens`` the range
    itself. ``anchor`` is the locked node ending at ``prefix``; it is ``None`` while ``prefix``
    is still being fetched by the ops in ``deps`` (in-flight fetches of the same pages are
    shared, not repeated) and is resolved when they have committed. The I/O thread advances
    ``done_pages`` after each verified chunk; the scheduling thread commits
    ``[committed_pages, done_pages)`` into the tree and moves the anchor down.
    """

    anchor: Node | None
    prefix: tuple[int, ...]
    tokens: tuple[int, ...]
    keys: list[PageKey]
    pages: torch.Tensor
    deadline: float
    deps: list[PrefetchOp] = field(default_factory=list)
    ckpt: torch.Tensor | None = None
    done_pages: int = 0
    committed_pages: int = 0
    released: bool = False
    closed: bool = False
    cancel: bool = False
    future: Future | None = None
    fences: list[Future] = field(default_factory=list)
    """``read_fence``s of short reads: until they are done an abandoned backend call may still
    write into pages past ``done_pages`` (or into ``staging``), so those stay allocated."""
    staging: list[torch.Tensor] = field(default_factory=list)
    agreed_done: int = 0
    """CP group: ``done_pages`` as every rank has it (the MIN at the last sync)."""
    agreed_settled: bool = False
    """CP group: whether the fetch could close on every rank at the last sync."""
    hold: int = -1
    """Test completion delay (``CacheConfig.test_completion_polls``): syncs left before the
    poll sees what the I/O verified (kept in ``landed`` meanwhile); -1: none."""
    landed: int = 0

    def publish(self, pages: int) -> None:
        """I/O thread: the first ``pages`` are verified (held back while ``hold`` lasts)."""
        if self.hold > 0:
            self.landed = pages
        else:
            self.done_pages = pages

    def tick(self, force: bool = False) -> None:
        """A sync queried this fetch: one query fewer to hold (``force``: none). When the hold
        ends, wait for the I/O and publish what it verified."""
        if self.hold <= 0:
            return
        self.hold = 0 if force else self.hold - 1
        if self.hold == 0:
            if self.future is not None:
                wait([self.future])
            self.done_pages = max(self.done_pages, self.landed)

    def io_done(self) -> bool:
        return self.hold <= 0 and self.future is not None and self.future.done()

    def unfenced(self) -> bool:
        """Whether no abandoned read can still write into this fetch's buffers."""
        return all(f.done() for f in self.fences)

    def pending_futures(self) -> list[Future]:
        """I/O futures of this fetch and the fetches it waits on that are still running."""
        own = [self.future] if self.future is not None and not self.future.done() else []
        return own + [f for d in self.deps for f in d.pending_futures()]

    def ready(self, policy: str) -> bool:
        """Whether a request waiting on this fetch may proceed under ``policy``."""
        if policy == "best_effort":
            return True
        if self.io_done() and all(d.ready(policy) for d in self.deps):
            return True
        return policy == "timeout" and time.monotonic() >= self.deadline

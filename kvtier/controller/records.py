"""Typed records of in-flight work, and the one place a node split re-attributes them.

Every in-flight operation lists the nodes it covers as ``Span``s. When the tree splits a node
the operation covers, the new parent shares the node's I/O counts (``RadixTree.split``), so it
needs a span of its own: ``split_spans`` gives it the head of the span's part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.transfer.op import TransferOp
from kvtier.tree.node import Node


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

    op: TransferOp
    spans: list[Span]
    tier: Literal["device", "host"]
    started: float = field(default_factory=time.perf_counter)


class Flights:
    """Device ↔ host copies of one kind in flight, oldest first (``Backups`` and ``Loads``)."""

    def __init__(self) -> None:
        self.flights: list[InFlight] = []

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

"""Placement of page envelopes in a unit map: first fit at the lowest address, and compaction.

A unit map is a ``bytearray`` with one byte per arena unit, 0 where the unit is free. Placing
``k`` units takes the lowest run of ``k`` free units (``bytearray.find`` of ``k`` zero bytes, so
the scan runs in C). These functions only compute on maps they are given; ``UnifiedPool`` owns
the real one and the bytes.

Within one pass where units are only taken, the lowest fit for a size never moves down (holes
only shrink), so each size's search resumes where its last fit was found: a pass scans the map
about once per distinct envelope size instead of once per envelope.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Envelope:
    """One envelope of the arena: ``size`` units from ``base``, of ``component`` of ``page``."""

    base: int
    size: int
    component: int
    page: int
    pinned: bool
    """Leased: compaction leaves it where it is."""


@dataclass(slots=True)
class Move:
    """Envelope of ``component`` of ``page`` moves ``size`` units from ``old`` down to ``new``."""

    component: int
    page: int
    old: int
    new: int
    size: int


def take(units: bytearray, at: int, size: int) -> None:
    units[at : at + size] = b"\x01" * size


def drop(units: bytearray, at: int, size: int) -> None:
    units[at : at + size] = bytes(size)


def place(units: bytearray, sizes: Sequence[int], n: int) -> list[list[int]] | None:
    """Bases for ``n`` pages, each taking one envelope of every size in ``sizes`` (in order),
    page by page at the lowest fit; ``units`` is updated. ``None`` when page ``i < n`` does not
    fit (``units`` then holds the first ``i`` pages: pass a copy to keep the original)."""
    return place_each(units, [sizes] * n)


def place_each(units: bytearray, pages: Sequence[Sequence[int]]) -> list[list[int]] | None:
    """As :func:`place`, each page with its own envelope sizes (``pages[i]``)."""
    out: list[list[int]] = []
    start: dict[int, int] = {}
    for sizes in pages:
        bases = []
        for k in sizes:
            at = units.find(bytes(k), start.get(k, 0))
            if at < 0:
                return None
            start[k] = at
            take(units, at, k)
            bases.append(at)
        out.append(bases)
    return out


def count(units: bytes | bytearray, sizes: Sequence[int], limit: int) -> int:
    """How many pages :func:`place` fits into ``units`` (a copy is used), at most ``limit``."""
    scratch = bytearray(units)
    start: dict[int, int] = {}
    for i in range(limit):
        for k in sizes:
            at = scratch.find(bytes(k), start.get(k, 0))
            if at < 0:
                return i
            start[k] = at
            take(scratch, at, k)
    return limit


def plan_compaction(
    units: bytes | bytearray, envelopes: Sequence[Envelope]
) -> tuple[list[Move], bytearray]:
    """Moves that close holes, and the unit map after them (``units`` is not changed).

    Unpinned envelopes, in address order, go to the lowest fit counting their own units as
    free (so a move may overlap its source); pinned ones stay. Without pins this packs every
    envelope from unit 0 in address order; with pins, holes below a pin are filled by envelopes
    above it that fit. Planning the result again moves nothing: a destination is never below a
    hole that fits, and a vacated source lies above every envelope placed before it.
    """
    scratch = bytearray(units)
    start: dict[int, int] = {}
    moves: list[Move] = []
    for e in sorted(envelopes, key=lambda e: e.base):
        if e.pinned:
            continue
        drop(scratch, e.base, e.size)
        at = scratch.find(bytes(e.size), start.get(e.size, 0))
        start[e.size] = at
        take(scratch, at, e.size)
        if at != e.base:
            moves.append(Move(e.component, e.page, e.base, at, e.size))
    return moves, scratch

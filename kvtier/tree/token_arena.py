"""Token arena: long token runs packed into large, huge-page-backed chunks.

A node's tokens are packed int32 bytes (``kvtier.tree.tokens``, which also compares arena runs
by address: ``memequal``). Short runs are ``bytes`` objects. A long run (``MIN_RUN`` bytes or
more: a long prompt) is copied into the arena instead and the node holds a read-only
``memoryview`` of it plus its address (``Node.addr``, for ``memcmp``). Why: a fresh ``bytes``
object of a few hundred KiB is a fresh ``mmap`` that faults in one 4 KiB page at a time, and
storing a long prompt's tokens costs far more in page faults than in copying; a chunk advised
for transparent huge pages faults once per 2 MiB.

Chunks are anonymous memory maps of ``CHUNK`` bytes (outside the Python heap, so ``tracemalloc``
does not see them: ``held_bytes`` says what they take), filled front to back. Each chunk counts its live bytes and knows its nodes. A chunk whose last node left is
dropped; a chunk (other than the one being filled) whose live bytes fell below a quarter of what
it holds moves its survivors to ``bytes`` and is dropped, so a few long-lived pieces never pin
many dead megabytes. A split keeps both parts in the chunk (views, no copy).

Owners: the tree calls ``store`` for a new node's tokens, ``adopt`` for a node created by a split,
``release`` for a node that leaves the tree. ``check`` verifies the accounting.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import IntegrityError
from kvtier.tree.tokens import HAS_MEMCMP

if TYPE_CHECKING:
    from kvtier.tree.node import Node

MIN_RUN = 64 << 10
"""Runs of at least this many bytes (16,384 tokens) go to the arena; shorter ones stay ``bytes``."""
CHUNK = 4 << 20
"""Bytes per chunk (a run longer than that gets a chunk of its own size)."""


@dataclass(slots=True, eq=False)
class _Chunk:
    data: memoryview
    """The chunk's bytes, writable (the arena's own)."""
    view: memoryview
    """``data`` read-only: what nodes slice."""
    addr: int
    used: int = 0
    live: int = 0
    nodes: set[Node] = field(default_factory=set)


class TokenArena:
    """The long token runs of one tree (see the module docstring)."""

    def __init__(self, min_run: int = MIN_RUN, chunk: int = CHUNK) -> None:
        if not HAS_MEMCMP or not hasattr(mmap, "MAP_ANONYMOUS"):  # every run stays ``bytes``
            min_run = 1 << 62
        self.min_run, self.chunk = min_run, chunk
        self._chunks: dict[int, _Chunk] = {}
        """By ``id`` of the chunk's memory map (a node view's ``.obj``)."""
        self._cur: _Chunk | None = None

    def store(self, node: Node, src: memoryview) -> None:
        """Give ``node`` a copy of the packed tokens ``src`` (a ``bytes`` or an arena run)."""
        n = len(src)
        if n < self.min_run:
            node.buf, node.addr = src.tobytes(), 0
            return
        c = self._cur
        if c is None or c.used + n > len(c.data):
            c = self._new_chunk(max(self.chunk, n))
            if n <= self.chunk:
                old, self._cur = self._cur, c
                if old is not None:
                    self._settle(old)  # no longer filled: dead space counts now
        at = c.used
        c.data[at : at + n] = src
        c.used += n
        node.buf, node.addr = c.view[at : at + n], c.addr + at
        c.live += n
        c.nodes.add(node)

    def adopt(self, node: Node) -> None:
        """Count ``node`` (a split's new part, whose tokens came out of another arena node)."""
        if node.addr:
            self._chunk_of(node).nodes.add(node)

    def release(self, node: Node) -> None:
        """``node`` left the tree: its run is dead (a no-op for ``bytes`` runs)."""
        if not node.addr:
            return
        c = self._chunk_of(node)
        c.nodes.discard(node)
        c.live -= len(node.buf)
        if c is not self._cur:
            self._settle(c)

    def _settle(self, c: _Chunk) -> None:
        """Drop the chunk ``c`` (not the one being filled) once dead, or moving out the few
        survivors of a mostly dead one. Views that dead nodes still hold keep its memory
        valid (nothing is ever written over a run), so only the tree lets go of it."""
        if c.live and c.live * 4 < c.used:
            for n in c.nodes:  # few survivors: move them out so the chunk can go
                n.buf, n.addr = n.buf.tobytes(), 0
            c.nodes.clear()
            c.live = 0
        if not c.live:
            del self._chunks[id(c.data.obj)]

    def _chunk_of(self, node: Node) -> _Chunk:
        buf = node.buf
        c = self._chunks.get(id(buf.obj)) if isinstance(buf, memoryview) else None
        if c is None:
            raise IntegrityError(f"{node!r} has an arena address but no arena run")
        return c

    def _new_chunk(self, size: int) -> _Chunk:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            with contextlib.suppress(OSError):  # huge pages off: only slower
                m.madvise(advice)
        data = memoryview(m)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(data))
        c = _Chunk(data, data.toreadonly(), addr)
        self._chunks[id(m)] = c
        return c

    def live_bytes(self) -> int:
        return sum(c.live for c in self._chunks.values())

    def held_bytes(self) -> int:
        """Bytes of every chunk (live, dead and not yet filled)."""
        return sum(len(c.data) for c in self._chunks.values())

    def check(self, nodes: list[Node]) -> None:
        """Every arena node's view and address point into a chunk that counts it; live counts
        are the sums of their nodes' runs. ``nodes``: every node of the tree."""
        seen: dict[int, list[Node]] = {}
        for n in nodes:
            if not n.addr:
                if not isinstance(n.buf, bytes):
                    raise IntegrityError(f"{n!r}: tokens of type {type(n.buf).__name__}")
                continue
            c = self._chunk_of(n)
            if np.frombuffer(n.buf, dtype=np.uint8).ctypes.data != n.addr:
                raise IntegrityError(f"{n!r}: arena address out of date")
            seen.setdefault(id(c), []).append(n)
        for c in self._chunks.values():
            mine = seen.get(id(c), [])
            if set(mine) != c.nodes or sum(len(n.buf) for n in mine) != c.live:
                raise IntegrityError(
                    f"arena chunk counts {len(c.nodes)} nodes / {c.live} bytes, tree has"
                    f" {len(mine)} / {sum(len(n.buf) for n in mine)}"
                )

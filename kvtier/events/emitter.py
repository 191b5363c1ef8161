"""``EventEmitter``: turns the tree's residency changes into KV events, one batch per step.

The tree tells it (``RadixTree.listen``) each time a node's pages become resident in a tier or
stop being resident there; it names the node's whole pages by their chained hashes
(``kvtier.events.hashing``: the hash of the whole prefix a page completes, from token ids) and
queues one ``BlockStored``/``BlockRemoved`` event per change. ``publish`` hands what a step
queued to the sink as one batch (``kvtier.events.wire``); the controller calls it at the end of
every poll. A partial last page has no hash and makes no event: a router matches whole pages.

Exactness: the tree keeps at most one node per page, so replaying the events of a run into one
set of hashes per tier gives the pages each tier holds (device, host), and for storage the
pages written or fetched and not known lost since. A batch the sink refuses (its queue is
full) is dropped whole and its events are counted in ``kv_events_dropped``; a consumer sees the
gap in the sequence numbers and asks the replay socket or resynchronises.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvtier.events.hashing import ROOT, chain_hashes
from kvtier.events.wire import all_blocks_cleared, block_removed, block_stored, event_batch
from kvtier.metrics import Metrics
from kvtier.tree.node import Node
from kvtier.tree.tokens import unpack

_REMEMBERED = 1 << 16
"""Nodes whose last page hash is remembered (past it the memory starts over)."""


class EventSink(Protocol):
    """Where batches go (``kvtier.events.publisher.ZmqPublisher``)."""

    def publish(self, batch: list) -> bool:
        """Queue ``batch`` without blocking; ``False`` if it was dropped (queue full)."""
        ...

    def close(self) -> None:
        """Send what is queued (bounded wait) and release the sockets."""
        ...


class EventEmitter:
    """Listens to one tree (``root``, pages of ``page_size`` tokens: the tree page is the
    block) and publishes batches of events to ``sink``."""

    def __init__(self, root: Node, page_size: int, sink: EventSink, metrics: Metrics) -> None:
        self.root = root
        self.page_size = page_size
        self.sink = sink
        self.metrics = metrics
        self.pending: list[list[Any]] = []
        """Events since the last batch, in the order the tree made the changes."""
        self._ends: dict[int, tuple[int, int]] = {}
        # node id -> (tokens from the root to the node's end, hash of its last whole page):
        # a split keeps the suffix's id and end, and gives the prefix a new id, so an entry
        # never goes stale while its node lives; it saves rehashing the prefix per event.
        self.pending.append(all_blocks_cleared())  # a (re)started instance holds nothing

    # ---- the tree's listener ----------------------------------------------------------------
    def changed(self, node: Node, tier: str, resident: bool) -> None:
        """``ResidencyListener``: queue the event of ``node``'s whole pages in ``tier``."""
        ps = self.page_size
        tokens = unpack(node.buf)
        whole = len(tokens) - len(tokens) % ps
        if not whole:
            return  # a lone partial page: no hash
        parent = self._end_hash(node.parent)
        ids = tokens[:whole].tolist()
        hashes = chain_hashes(ids, ps, parent)
        self._remember(node, whole, hashes[-1])
        if resident:
            first = None if node.depth == 0 else parent  # vLLM: no parent for a first page
            self.pending.append(block_stored(hashes, first, ids, ps, tier))
        else:
            self.pending.append(block_removed(hashes, tier))

    # ---- batches ------------------------------------------------------------------------
    def publish(self) -> None:
        """Hand the events queued since the last batch to the sink as one batch (nothing
        when there are none). Never blocks; a refused batch is counted and dropped."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        if not self.sink.publish(event_batch(time.time(), events)):
            self.metrics.inc("kv_events_dropped", len(events))

    def close(self) -> None:
        """The instance stops serving: publish what is queued and ``AllBlocksCleared``, then
        close the sink."""
        self.pending.append(all_blocks_cleared())
        self.publish()
        self.sink.close()

    # ---- hashes ---------------------------------------------------------------------------
    def _end_hash(self, node: Node | None) -> int:
        """Hash of the last page of the prefix ending with ``node`` (``ROOT`` for the root):
        walks up to the nearest remembered ancestor, then hashes down."""
        chain: list[Node] = []
        h = ROOT
        n = node
        while n is not None and n is not self.root:
            end = n.depth + n.num_tokens - n.num_tokens % self.page_size
            got = self._ends.get(n.id)
            if got is not None and got[0] == end:
                h = got[1]
                break
            chain.append(n)
            n = n.parent
        ps = self.page_size
        for n in reversed(chain):
            # an inner node holds whole pages only (a partial page ends a leaf)
            hashes = chain_hashes(unpack(n.buf).tolist(), ps, h)
            if hashes:
                h = hashes[-1]
            self._remember(n, n.num_tokens - n.num_tokens % ps, h)
        return h

    def _remember(self, node: Node, whole: int, h: int) -> None:
        if len(self._ends) >= _REMEMBERED:
            self._ends.clear()
        self._ends[node.id] = (node.depth + whole, h)

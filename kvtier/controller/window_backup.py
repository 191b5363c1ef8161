"""Window-only backups: the window rows of pages whose host copy was made without them.

A window pool's page loses its window rows once the engine's queries leave them behind, so the
host copy of a long request's early pages has none (``Node.ckpt`` false). When a later request
computes those pages again and its window rows are kept on the cached device page
(``EnginePages`` hands them over at insert), the anchor component already has its host copy:
only the window rows need copying. This copies them into the existing host pages, sets the host
flags when the copy landed and writes the pages again so storage gets their window objects (a
page object already stored is skipped by the backend).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.controller.records import Flights, InFlight, Span
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.pools.host_arena import HostArena
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.mover import Mover
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree


class WindowBackups(Flights):
    """Window-only device → host copies in flight. Each span's ``part`` is a bool mask over
    its node's pages (the pages copied), so a split divides it like the node."""

    def __init__(
        self,
        tree: RadixTree,
        pool: UnifiedPool,
        mover: Mover,
        window: str,
        rewrite: Callable[[list[Node]], None],
        metrics: Metrics,
        group: Group | None = None,
    ) -> None:
        """``window`` names the window component; ``rewrite(nodes)`` writes their host copies
        to storage again."""
        self.tree = tree
        self.pool = pool
        self.mover = mover
        self.window = window
        self._rewrite = rewrite
        self.metrics = metrics
        super().__init__(group)

    def start(self, nodes: list[Node]) -> int:
        """Copy the window rows ``nodes``' device pages have and their host copies lack;
        returns the pages queued. Other copies of the node may be in flight: they read rows
        this one does not write (a storage write or a load reads only the flagged pages'
        window rows, and this writes only unflagged ones). A node with a window-only copy in
        flight is skipped."""
        busy = {id(sp.node) for f in self.flights for sp in f.spans}
        spans: list[Span] = []
        for node in nodes:
            if node.device is None or node.host is None or node.ckpt is None:
                continue
            if id(node) in busy:
                continue
            need = self.pool.has_window(node.device) & ~node.ckpt
            if not bool(need.any()):
                continue
            host = self.mover.host
            if isinstance(host, HostArena) and not host.add_window(node.host[need]):
                continue  # no room for the rows in the host arena: the copy stays without
            self.tree.begin_io(node, "device")
            self.tree.begin_io(node, "host")
            spans.append(Span(node, need))
        if not spans:
            return 0
        dev = torch.cat([sp.node.device[sp.part] for sp in spans])  # type: ignore[index]
        host = torch.cat([sp.node.host[sp.part] for sp in spans])  # type: ignore[index]
        op = self.mover.device_to_host(dev, host, components=(self.window,))
        self.flights.append(InFlight(op, spans, "device"))
        return dev.numel()

    def poll(self) -> None:
        """Complete the copies that landed: their pages' host flags go up, and storage is
        asked for the window objects."""
        done: list[Node] = []
        for flight in self.finished():
            flight.op.complete()
            self.flights.remove(flight)
            for sp in flight.spans:
                node = sp.node
                self.tree.end_io(node, "device")
                self.tree.end_io(node, "host")
                if node.ckpt is not None and node.host is not None:
                    node.ckpt = node.ckpt | sp.part  # type: ignore[operator]
                    done.append(node)
            self.metrics.inc("window_backup_pages", flight.op.num_pages)
            self.metrics.inc("window_backup_seconds", time.perf_counter() - flight.started)
        if done:
            self._rewrite(done)

    def pinned(self) -> list[tuple[Node, str]]:
        """Each copy reads the device copy and writes the host copy of its nodes."""
        return [(sp.node, t) for f in self.flights for sp in f.spans for t in ("device", "host")]

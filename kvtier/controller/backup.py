"""Backups: device → host copies, then host → storage writes, and the storage tier's recency.

A backup copy pins the device copy it reads (``device_io``) and owns the host pages it writes
until it completed; only then, at a poll, do the pages become the node's host copy (contract
3). A full host tier drops a backup (counted), it never blocks; with a ``staging`` buffer
(``host_mode='buffer_only'``) the backup waits for room instead and goes in chunks
(``kvtier.controller.staging``). A storage write pins the host
copy it reads (``host_io``) until it is reaped; the node is marked stored only when every page
(and, for state models, every valid checkpoint) landed. Which host copies are written at all
is ``storage_admission``'s to say (``kvtier.controller.storage_admission``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.controller.host_leases import HostLeases
from kvtier.controller.layered import Joined, Reservation, Reservations
from kvtier.controller.records import Flights, InFlight, Span
from kvtier.controller.staging import Staging
from kvtier.controller.storage_admission import StorageAdmission
from kvtier.controller.storage_io import StorageIO
from kvtier.errors import IntegrityError
from kvtier.keys import Namespace
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.pools.host import HostPool
from kvtier.pools.host_arena import HostArena
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.layers import Layered
from kvtier.transfer.mover import Mover
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree


class Backups(Flights):
    """Device → host → storage; ``io`` is ``None`` without an L3 tier. ``alloc_host(pages)``
    allocates host pages for a copy of device ``pages`` (on their lanes under CP)."""

    def __init__(
        self,
        tree: RadixTree,
        host: HostPool,
        mover: Mover,
        alloc_host: Callable[[torch.Tensor], torch.Tensor | None],
        namespace: Namespace,
        metrics: Metrics,
        group: Group | None = None,
    ) -> None:
        self.tree = tree
        self.host = host
        self.mover = mover
        self._alloc_host = alloc_host
        self.namespace = namespace
        self.metrics = metrics
        self.io: StorageIO | None = None
        self.reserved = Reservations(host, group)
        self._forwards: dict[int, Reservation] = {}
        """Reservations of forwards still running, by ``id`` of their copy."""
        self.staging: Staging | None = None
        """The staging rules of ``host_mode='buffer_only'`` (``None``: the host tier caches)."""
        self.leases = HostLeases(None)
        """The storage I/O's leases on a relocatable host pool (set by the controller)."""
        self.admission: StorageAdmission | None = None
        """Which host copies storage gets (``None``: all of them; set by the controller)."""
        super().__init__(group)

    # ---- device → host ------------------------------------------------------------------
    def to_host(self, nodes: list[Node]) -> InFlight | None:
        """Start one batched copy giving ``nodes`` host copies (skipping those that have one
        or are getting one); ``None`` when nothing was started. With ``staging`` the nodes
        queue and the chunks the host pool has room for start now."""
        if self.staging is not None:
            self.staging.enqueue(nodes)
            return self._copy(self.staging.chunks())
        spans: list[Span] = []
        made: list[InFlight] = []
        for node in nodes:
            if node.device is None or node.on_host or node.device_io:
                if node.device is not None:
                    self.reserved.release(node.device)
                continue
            early = self.reserved.take(node.device)
            if early is not None:  # copied during the forward (per-layer backup)
                ops, host = early
                missing = host < 0
                if bool(missing.any()):  # pages no forward copied: copy them now
                    rest = self._alloc_host(node.device[missing])
                    if rest is None:
                        self.reserved.orphan(ops, host[~missing])
                        self.metrics.inc("dropped_host_backups", node.device.numel())
                        continue
                    host[missing] = rest
                    ops.append(self.mover.device_to_host(node.device[missing], rest))
                op = ops[0] if len(ops) == 1 else Joined(ops)
                self.tree.begin_io(node, "device")
                owned = self.mover.translator.device_owned(node.device)
                n = node.device.numel() if owned is None else int(owned.sum())
                made.append(InFlight(op, [Span(node, host)], "device", pages=n))
                continue
            pages = self._alloc_host(node.device)
            if pages is None:
                self.metrics.inc("dropped_host_backups", node.device.numel())
                continue
            self.tree.begin_io(node, "device")
            spans.append(Span(node, pages))
        self.flights += made
        return self._copy(spans) or (made[-1] if made else None)

    def _copy(self, spans: list[Span]) -> InFlight | None:
        """Start one batched copy of the device copies of ``spans``' nodes into their parts
        (host pages); the nodes' device copies must be pinned for it already."""
        if not spans:
            return None
        dev = torch.cat([sp.node.device for sp in spans])  # type: ignore[misc]
        host = torch.cat([sp.part for sp in spans])  # type: ignore[misc]
        flight = InFlight(self.mover.device_to_host(dev, host), spans, "device")
        self.flights.append(flight)
        return flight

    def wait(self) -> None:
        """Block until every copy in flight completed; with ``staging``, until every queued
        backup is stored (or dropped), or nothing in flight can free the host pages the queue
        waits for (pages that requests or fetches hold: the queue moves once they let go)."""
        super().wait()
        self.reserved.wait()
        while self.staging is not None:
            self._copy(self.staging.chunks())  # room freed since the last poll (an unlock)
            if not (self.flights or self._writing()):
                break
            super().wait()
            if self.io is not None:
                self.io.wait_all()
            self.poll()

    def _writing(self) -> bool:
        return self.io is not None and bool(self.io.pinned())

    # ---- per-layer backups --------------------------------------------------------------
    def reserve(self, device: torch.Tensor) -> Layered | None:
        """Reserve host pages for a copy of the engine's ``device`` pages made during the
        coming forward; ``None`` (nothing reserved, counted) when the host tier is short."""
        if not device.numel():
            return None
        host = self._alloc_host(device)
        if host is None:
            self.metrics.inc("dropped_layer_backups", device.numel())
            return None
        layered = self.mover.layered_backup(device, host)
        if layered is None:
            self.host.allocator.free(host)
            return None
        res = Reservation(layered, device.clone(), host)
        self.reserved.add(res)
        self._forwards[id(layered)] = res
        self.metrics.inc("layer_backup_pages", device.numel())
        return layered

    def finish_layers(self, layered: Layered, ok: bool = True) -> None:
        """The forward ended: the copy's op is complete once its last rows land. Not ``ok``:
        the copy is given up (its host pages are freed once it is done)."""
        res = self._forwards.pop(id(layered))
        res.op = layered.finish()
        if not ok:
            self.reserved.release(res.device)

    def _finish(self, flight: InFlight) -> None:
        flight.op.complete()
        self.flights.remove(flight)
        stored: list[Node] = []
        for sp in flight.spans:
            self.tree.end_io(sp.node, "device")
            if sp.node.host is None and sp.node.parent is not None:
                flags = self._host_flags(sp.node, sp.part)
                self.tree.set_host(sp.node, sp.part, flags)
                if isinstance(self.host, HostArena) and flags is not None:
                    # A copy without window rows keeps only its anchor's bytes.
                    self.host.release_window(sp.part[~flags & self.host.has_window(sp.part)])
                stored.append(sp.node)
            else:  # the node got a host copy meanwhile, or left the tree
                self.host.allocator.free(sp.part)
        # A per-layer copy serves several nodes' flights: each counts its own pages once.
        pages = flight.op.num_pages if flight.pages is None else flight.pages
        self.metrics.inc("host_backup_pages", pages)
        self.metrics.inc("backup_bytes", pages * self.host.page_bytes)
        self.metrics.inc("backup_seconds", time.perf_counter() - flight.started)
        self.to_storage(stored)
        if self.staging is not None:  # freed once written (or at once if already stored)
            for node in stored:
                self.staging.mark(node)

    def loaded(self, nodes: list[Node]) -> None:
        """Loads of ``nodes``' host copies completed: with ``staging`` the copies are freed
        and the room goes to queued backups."""
        if self.staging is not None:
            self.staging.loaded(nodes)
            self._copy(self.staging.chunks())

    def _host_flags(self, node: Node, host: torch.Tensor) -> torch.Tensor | None:
        """A window pool's host copy holds the window rows its device pages had and its
        ``host`` pages had room for (the copy skips the others); ``None`` for every other
        pool."""
        dev = self.mover.dev
        if node.device is None or not isinstance(dev, UnifiedPool):
            return None
        flags = dev.has_window(node.device)
        if isinstance(self.host, HostArena):
            flags &= self.host.has_window(host)
        return flags

    # ---- host → storage -----------------------------------------------------------------
    def to_storage(self, nodes: list[Node]) -> None:
        """Write the host copies of ``nodes`` that storage lacks and ``admission`` lets in (one
        batch)."""
        if self.io is None:
            return
        todo = [
            n
            for n in nodes
            if n.on_host and not n.in_storage and not n.host_io and n.parent is not None
        ]
        if self.admission is not None:
            todo = self.admission.admit(todo, self.io.pages.nbytes)
        self._write(todo)

    def _write(self, todo: list[Node]) -> None:
        """Write ``todo``'s host copies (pinned and leased until reaped)."""
        if todo and self.io is not None:
            keys = [self.tree.ensure_keys(n, self.namespace) for n in todo]
            for node in todo:
                self.tree.begin_io(node, "host")
                self.leases.hold(node.host)  # type: ignore[arg-type]
            self.io.write(todo, keys)

    def rewrite(self, nodes: list[Node]) -> None:
        """Write the host copies of ``nodes`` to storage again, stored or not: objects of
        their partial component were added since (``WindowBackups``)."""
        if self.io is None:
            return
        self._write([n for n in nodes if n.on_host and not n.host_io and n.parent is not None])

    def touch(self, path: list[Node]) -> None:
        """A request locked ``path``: refresh the storage recency of its stored nodes (a hit at
        any tier is a use of their objects), batched until the next poll."""
        if self.io is not None:
            self.io.queue_touch(path, lambda n: self.tree.ensure_keys(n, self.namespace))

    # ---- progress -----------------------------------------------------------------------
    def poll(self) -> None:
        """Complete finished copies (their host copies become visible), reap storage writes
        and touches; nodes whose objects are gone are written again."""
        for flight in self.finished():
            self._finish(flight)
        self.reserved.poll()
        if self.io is None:
            return
        reaped = self.io.reap_writes()
        # A write the backend abandoned by timeout may still read its pages: leases stay.
        fence = self.io.backend.write_fence() if reaped and self.leases.arena else None
        for sp, stored in reaped:
            if sp.node.host is not None:
                self.leases.drop(sp.node.host, fence)
            self.tree.end_io(sp.node, "host")
            if stored:
                self.tree.set_in_storage(sp.node, True)
            if self.staging is not None:
                self.staging.written(sp.node, stored)
        if self.staging is not None:  # freed host pages take the next queued chunks
            self.staging.release_idle()
            self._copy(self.staging.chunks())
        lost = self.io.reap_touches()
        for node in lost:
            self.tree.set_in_storage(node, False)
        self.to_storage(lost)
        if self.staging is not None:  # gone from storage and no host copy: back up again
            self.staging.enqueue(lost)
            self._copy(self.staging.chunks())
        self.io.flush_touches()

    def inflight_host_pages(self) -> int:
        """Host pages owned by copies in flight rather than by the tree."""
        n = sum(sp.part.numel() for f in self.flights for sp in f.spans)  # type: ignore[union-attr]
        return n + self.reserved.host_pages()

    def pinned(self) -> list[tuple[Node, str]]:
        """``(node, tier)`` once for every pin in-flight backups, writes and queued backups
        hold."""
        out = super().pinned()
        if self.staging is not None:
            out += self.staging.pinned()
        if self.io is not None:
            out += [(sp.node, "host") for sp in self.io.pinned()]
        return out

    def check_integrity(self) -> None:
        if self.staging is not None:
            self.staging.check_integrity()
        for f in self.flights:
            for sp in f.spans:
                if sp.part is None or sp.node.device is None:
                    raise IntegrityError(f"backup of {sp.node!r} without pages or device copy")

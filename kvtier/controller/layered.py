"""Host copies made during the forward (``CacheConfig.backup_timing='per_layer'``, seed 004).

Before a forward the engine asks for the pages that will be full after it and are its own
(:meth:`Reservations.reserve`): the tree is probed first, so pages whose tokens already have a
host copy are not copied twice; host pages are reserved on the device pages' lanes, and the
mover copies each layer as the forward finishes it (``kvtier.transfer.layers``). The copies
stay the reservation's until the pages are inserted: then ``Backups.to_host`` hands them to the
node as a backup in flight (visible at the poll after the copy completed, like any backup, so
``match`` never sees a half-copied node). Reserved pages the tree never takes (a duplicate, a
failed request, a node that got a host copy meanwhile) are released once their copy is done.

Under context parallelism each rank copies its own shard of the pages (the mover keeps the
pages this rank owns) into host pages reserved on the owners' lanes; every rank reserves,
takes and releases the same pages at the same calls. A released page is freed once every
rank's copy of it is done (the MIN of the in-flight records, ``records.finished``), so the
host allocators stay identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.controller.records import finished
from kvtier.errors import IntegrityError
from kvtier.parallel.group import Group, SoloGroup
from kvtier.pools.host import HostPool
from kvtier.transfer.layers import Layered
from kvtier.transfer.op import TransferOp


@dataclass(slots=True, eq=False)
class Reservation:
    """One forward's per-layer backup."""

    layered: Layered
    device: torch.Tensor
    """Logical device pages copied (the engine's)."""
    host: torch.Tensor
    """Reserved host pages, aligned with ``device``."""
    op: TransferOp | None = None
    """Set when the forward finished (``Layered.finish``)."""


class Joined:
    """Several forwards' copies standing for one node's backup: done when all are."""

    def __init__(self, ops: list[TransferOp]) -> None:
        self.ops = ops
        self.num_pages = sum(op.num_pages for op in ops)
        self.nbytes = sum(op.nbytes for op in ops)

    def done(self) -> bool:
        return all(op.done() for op in self.ops)

    def wait(self) -> None:
        for op in self.ops:
            op.wait()

    def complete(self) -> None:
        for op in self.ops:
            op.complete()


class Reservations:
    """Reserved host pages by engine device page; the host allocator still owns them.
    ``group``: the CP group whose ranks must free released pages at the same poll."""

    def __init__(self, host: HostPool, group: Group | None = None) -> None:
        self.host = host
        self.group: Group = group or SoloGroup()
        self._by_page: dict[int, tuple[int, Reservation]] = {}
        self._orphans: list[
            tuple[TransferOp | Joined | None, Reservation | None, torch.Tensor]
        ] = []

    def add(self, res: Reservation) -> None:
        for d, h in zip(res.device.tolist(), res.host.tolist(), strict=True):
            if d in self._by_page:
                raise IntegrityError(f"device page {d} reserved for two per-layer backups")
            self._by_page[d] = (h, res)

    def take(self, device: torch.Tensor) -> tuple[list[TransferOp], torch.Tensor] | None:
        """The copies and host pages finished forwards reserved for the pages of ``device``
        (a node being inserted; its pages may come from several forwards, its prefill and
        decode steps): the ops and, per page, its host page or -1 where none was reserved
        (a partial tail page, say). ``None`` when none of them was reserved. Reservations
        still in an unfinished forward are released."""
        pages = device.tolist()
        found = [self._by_page.get(p) for p in pages]
        if any(f is not None and f[1].op is None for f in found):
            self.release(device)
            return None
        if all(f is None for f in found):
            return None
        ops: dict[int, TransferOp] = {}
        host = []
        for p, f in zip(pages, found, strict=True):
            if f is None:
                host.append(-1)
                continue
            h, res = f
            del self._by_page[p]
            ops[id(res.op)] = res.op  # type: ignore[assignment]
            host.append(h)
        return list(ops.values()), torch.tensor(host, dtype=torch.int64)

    def release(self, device: torch.Tensor) -> None:
        """Give up the reservations of ``device`` pages: their host pages are freed once the
        copy writing them is done (:meth:`poll`)."""
        for p in device.reshape(-1).tolist():
            got = self._by_page.pop(p, None)
            if got is None:
                continue
            h, res = got
            self._orphans.append((res.op, res, torch.tensor([h], dtype=torch.int64)))

    def orphan(self, ops: list[TransferOp], host: torch.Tensor) -> None:
        """Taken host pages the node could not use after all: freed once ``ops`` are done."""
        joined = ops[0] if len(ops) == 1 else Joined(ops)
        for h in host.tolist():
            self._orphans.append((joined, None, torch.tensor([h], dtype=torch.int64)))

    def poll(self) -> None:
        """Free released host pages whose copy can no longer write them (on every rank:
        under CP, the leading released pages whose copy is done everywhere)."""
        if not self._orphans:  # the same on every rank: they release at the same calls
            return
        ready = finished(self._orphans, self._copied, self.group)
        gone = {id(item) for item in ready}  # alone: every done one, in any order
        for _, _, pages in ready:
            self.host.allocator.free(pages)
        self._orphans = [item for item in self._orphans if id(item) not in gone]

    @staticmethod
    def _copied(item: tuple[TransferOp | Joined | None, Reservation | None, torch.Tensor]) -> bool:
        op, res, _ = item
        op = op or (res.op if res is not None else None)
        return op is not None and op.done()

    def wait(self) -> None:
        for op, res, _ in self._orphans:
            op = op or (res.op if res is not None else None)
            if op is not None:
                op.wait()
        self.poll()

    def host_pages(self) -> int:
        """Host pages held by reservations and released copies still in flight."""
        return len(self._by_page) + sum(p.numel() for _, _, p in self._orphans)

    def busy(self) -> bool:
        return bool(self._orphans)

"""Loads: host → device copies of a locked path, in path order, with the shorter-prefix
fallback: when the device pool cannot take a node whole, its first pages that fit are split
off and loaded, so a request resumes from as deep as the pool allows (not from the last whole
node). A load pins the host copy it reads (``host_io``) until it completed; the compute stream
waits for it before any kernel reads (or per layer, with overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.controller.records import Flights, InFlight, Span
from kvtier.errors import IntegrityError
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.pools.device import DevicePool
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.mover import Mover
from kvtier.transfer.op import TransferOp
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree


@dataclass(slots=True, eq=False)
class _Load:
    """Device ``pages`` allocated for ``host``, the host copy of ``node`` (the ``at``-th node
    of the loaded path) or, when ``split``, its first pages: what fits."""

    at: int
    node: Node
    host: torch.Tensor
    pages: torch.Tensor
    split: bool


class Loads(Flights):
    """Host → device copies in flight. ``alloc_device(pages)`` allocates device pages for a
    copy of host ``pages`` (on their lanes under CP), evicting if needed."""

    def __init__(
        self,
        tree: RadixTree,
        dev: DevicePool,
        mover: Mover | None,
        alloc_device: Callable[[torch.Tensor], torch.Tensor | None],
        metrics: Metrics,
        group: Group | None = None,
    ) -> None:
        self.tree = tree
        self.dev = dev
        self.mover = mover
        self._alloc_device = alloc_device
        self.metrics = metrics
        self.on_loaded: Callable[[list[Node]], None] | None = None
        """Told of the nodes whose load completed (``host_mode='buffer_only'`` frees their
        host copies, ``kvtier.controller.staging``)."""
        super().__init__(group)

    def load(self, path: list[Node], overlap: bool = False) -> tuple[int, list | None]:
        """Give the host-only nodes of the locked ``path`` device copies, in order.

        Stops at the first node that does not fit, after loading the part of it that does
        (``path`` is updated in place: that node is split, its first part inserted before
        it). Returns how many leading nodes of ``path`` are device-resident now, and with
        ``overlap`` the per-layer arrival events of the copy (``None`` without a copy).

        The tree learns of the load only once its copy is queued: a failure on the way (no
        page after all, the copy refused) gives back every device page allocated for it, with
        whatever envelopes it still holds, leaves ``path`` and every node as they were (no
        split, no device copy, no pin) and propagates; the lock stays the caller's.
        """
        loads: list[_Load] = []
        try:
            loaded = self._allocate(path, loads)
            op = self._copy(loads, overlap)
        except BaseException:
            self._give_back(loads)
            raise
        if op is None:
            return loaded, None
        spans: list[Span] = []
        for ld in loads:
            node = ld.node
            if ld.split:
                node = self.tree.split(node, ld.pages.numel())
                path.insert(ld.at, node)
            if node.origin is None:
                self.tree.set_origin(node, "host")
            self.tree.set_device(node, ld.pages)
            self.tree.begin_io(node, "host")
            spans.append(Span(node))
        self.flights.append(InFlight(op, spans, "host"))
        return loaded, op.layer_events

    def _allocate(self, path: list[Node], loads: list[_Load]) -> int:
        """Device pages for the host-only nodes of ``path``, in order, into ``loads`` (window
        envelopes bound); returns how many leading nodes of ``path`` they make resident. The
        last may cover the first part of its node only (what fits)."""
        loaded = 0
        while loaded < len(path):
            node = path[loaded]
            if node.on_device:
                loaded += 1
                continue
            if node.host is None:
                raise IntegrityError(f"load of {node!r}: locked without any copy")
            host = node.host
            pages = self._alloc_device(host)
            if pages is None:
                # What eviction could free is free now: the leading pages whose lanes have
                # room are the quota (evictable device cache counted, seed 004).
                fit = self.dev.allocator.fit_like(host)
                if fit == 0 or self.mover is None:
                    break
                host = host[:fit]
                pages = self._alloc_device(host)
                if pages is None:
                    raise IntegrityError(f"{fit} device pages free but not allocatable")
            split = host.numel() < node.host.numel()
            loads.append(_Load(loaded, node, host, pages, split))
            self._bind_windows(node, pages)
            loaded += 1
            if split:
                break
        return loaded

    def _copy(self, loads: list[_Load], overlap: bool) -> TransferOp | None:
        """Queue the host → device copy of ``loads`` (``None`` when there is none)."""
        if not loads:
            return None
        if self.mover is None:
            raise IntegrityError("host copies to load but no mover (no host tier)")
        host = torch.cat([ld.host for ld in loads])
        dev = torch.cat([ld.pages for ld in loads])
        return self.mover.host_to_device(host, dev, overlap=overlap)

    def _give_back(self, loads: list[_Load]) -> None:
        """The device pages of a load that failed before the tree knew of it go back to the
        allocator, every envelope they still hold with them."""
        if not loads:
            return
        stream = self.mover.load_stream if self.mover is not None else None
        if stream is not None:
            # Copies queued before the failure land before their pages can be reused.
            stream.synchronize()
        self.dev.free_pages(torch.cat([ld.pages for ld in loads]))

    def _bind_windows(self, node: Node, pages: torch.Tensor) -> None:
        """A window pool's fresh pages come with window rows; those of pages whose host copy
        has none go back before anything is copied, so the copy skips them (a page without
        window rows is not copied into)."""
        if node.ckpt is None or not isinstance(self.dev, UnifiedPool):
            return
        drop = pages[~node.ckpt[: pages.numel()]]
        if drop.numel():
            self.dev.release_window(drop)

    def poll(self) -> None:
        for flight in self.finished():
            self.flights.remove(flight)
            flight.op.complete()
            for sp in flight.spans:
                self.tree.end_io(sp.node, "host")
            self.metrics.inc("load_bytes", flight.op.nbytes)
            self.metrics.inc("load_seconds", time.perf_counter() - flight.started)
            if self.on_loaded is not None:
                self.on_loaded([sp.node for sp in flight.spans])

"""Loads: host → device copies of a locked path, in path order, with the shorter-prefix
fallback: when the device pool cannot take a node whole, its first pages that fit are split
off and loaded, so a request resumes from as deep as the pool allows (not from the last whole
node). A load pins the host copy it reads (``host_io``) until it completed; the compute stream
waits for it before any kernel reads (or per layer, with overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.controller.records import Flights, InFlight, Span
from kvtier.errors import IntegrityError
from kvtier.metrics import Metrics
from kvtier.parallel.group import Group
from kvtier.pools.device import DevicePool
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.mover import Mover
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree


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
        """
        spans: list[Span] = []
        dev: list[torch.Tensor] = []
        loaded = 0
        while loaded < len(path):
            node = path[loaded]
            if node.on_device:
                loaded += 1
                continue
            if node.host is None:
                raise IntegrityError(f"load of {node!r}: locked without any copy")
            want = node.host.numel()
            pages = self._alloc_device(node.host)
            if pages is None:
                # What eviction could free is free now: the leading pages whose lanes have
                # room are the quota (evictable device cache counted, seed 004).
                fit = self.dev.allocator.fit_like(node.host)
                if fit == 0 or self.mover is None:
                    break
                path.insert(loaded, self.tree.split(node, fit))
                node = path[loaded]
                pages = self._alloc_device(node.host)
                if pages is None:
                    raise IntegrityError(f"{fit} device pages free but not allocatable")
            self._bind_windows(node, pages)
            spans.append(Span(node, node.host))
            dev.append(pages)
            if node.origin is None:
                self.tree.set_origin(node, "host")
            self.tree.set_device(node, pages)
            self.tree.begin_io(node, "host")
            loaded += 1
            if pages.numel() < want:
                break
        if not spans:
            return loaded, None
        if self.mover is None:
            raise IntegrityError("host copies to load but no mover (no host tier)")
        host = torch.cat([sp.part for sp in spans])  # type: ignore[misc]
        op = self.mover.host_to_device(host, torch.cat(dev), overlap=overlap)
        self.flights.append(InFlight(op, [Span(sp.node) for sp in spans], "host"))
        return loaded, op.layer_events

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

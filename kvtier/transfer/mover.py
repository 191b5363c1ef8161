"""Device ↔ host page transfers.

Both pools are viewed in the *object layout* ``[n_pages, layers, page_size, *row]`` so a batch
is one gather on the source side and one scatter on the destination side per component, never a
per-page Python loop. On CUDA the copy runs on the mover's own stream through pinned staging
buffers and completes asynchronously: ``TransferOp.done()`` polls its event without blocking.
On CPU copies are synchronous and ops are born done; the caller's visibility rules are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.paging import check_whole_pages, pages_to_locs
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.transfer.mapped import map_pinned
from kvtier.transfer.translate import IdentityTranslator, PageTranslator


@dataclass(slots=True)
class TransferOp:
    """One batched copy. ``finalize`` runs once, on the host, after the copy completed."""

    direction: str
    num_pages: int
    nbytes: int
    event: torch.cuda.Event | None = None
    layer_events: list[torch.cuda.Event] | None = None
    finalize: Callable[[], None] | None = None
    keepalive: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False

    def done(self) -> bool:
        """True once the copy completed (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the copy completed."""
        if self.event is not None:
            self.event.synchronize()

    def complete(self) -> None:
        """Run the host-side finalisation exactly once (call only when ``done()``)."""
        if not self.finished:
            self.finished = True
            if self.finalize is not None:
                self.finalize()
            self.keepalive.clear()


DMA_MIN_RUN = 8
"""Mean pages per run below which scattered loads use gather kernels instead of copy engines."""


class Mover:
    """Copies pages between one device pool and one host pool."""

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        translator: PageTranslator | None = None,
        debug_checks: bool = False,
    ) -> None:
        self.dev = device_pool
        self.host = host_pool
        self.translator = translator or IdentityTranslator()
        self.debug_checks = debug_checks
        self.cuda = device_pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device_pool.device) if self.cuda else None
        # Pinned host pools are reached by kernels through device views; an unpinned one
        # goes through pinned staging copies instead.
        self.mapped: dict[str, torch.Tensor] = {}
        if self.cuda and host_pool.pinned:
            for name, buf in host_pool.buffers.items():
                view = map_pinned(buf, device_pool.device)
                self.mapped[name] = host_pool.page_bytes_view(name, view)

    def _check(self, pages: torch.Tensor, what: str) -> None:
        if self.debug_checks:
            check_whole_pages(pages_to_locs(pages, self.dev.page_size), self.dev.page_size, what)

    def device_to_host(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> TransferOp:
        """Copy device pages into host pages (a backup). The host copy is valid once done."""
        self._check(device_pages, "device_to_host source")
        phys = self.translator.device_physical(device_pages)
        op = TransferOp("d2h", phys.numel(), phys.numel() * self.dev.page_bytes)
        if not self.cuda:
            for name in self.dev.buffers:
                src, dst = self.dev.page_bytes_view(name), self.host.page_bytes_view(name)
                for layer in range(src.shape[0]):  # one row gather + scatter per layer
                    dst[layer].index_copy_(0, host_pages, src[layer].index_select(0, phys))
            return op
        assert self.stream is not None
        idx = phys.to(self.dev.device, non_blocking=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.dev.device))
        if self.mapped:
            hp = host_pages.to(self.dev.device, non_blocking=True)
            with torch.cuda.stream(self.stream):
                for name, dst in self.mapped.items():
                    gathered = self.dev.page_bytes_view(name).index_select(1, idx)
                    _scatter_pages(dst, hp, gathered)
                    op.keepalive.append(gathered)
                op.event = torch.cuda.Event()
                op.event.record(self.stream)
            return op
        staged: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for name in self.dev.buffers:
                gathered = self.dev.page_bytes_view(name).index_select(1, idx)
                pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                pinned.copy_(gathered, non_blocking=True)
                staged[name] = pinned
                op.keepalive.append(gathered)
            op.event = torch.cuda.Event()
            op.event.record(self.stream)

        def finalize() -> None:
            for name, pinned in staged.items():
                dst = self.host.page_bytes_view(name)
                for layer in range(dst.shape[0]):
                    dst[layer].index_copy_(0, host_pages, pinned[layer])

        op.finalize = finalize
        return op

    def host_to_device(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor, overlap: bool = False
    ) -> TransferOp:
        """Copy host pages into device pages (a load-back).

        On CUDA the compute stream is made to wait for the copy, so kernels issued after this
        call read the loaded pages without the host ever blocking. With ``overlap`` (CUDA with
        a pinned host pool) the compute stream is not made to wait: the anchor component is
        copied layer by layer, after every other component, and ``op.layer_events[i]`` marks
        anchor layer ``i`` (and everything before it) as arrived; the caller waits per layer.
        """
        self._check(device_pages, "host_to_device destination")
        phys = self.translator.device_physical(device_pages)
        op = TransferOp("h2d", phys.numel(), phys.numel() * self.dev.page_bytes)
        if not self.cuda:
            for name in self.dev.buffers:
                src, dst = self.host.page_bytes_view(name), self.dev.page_bytes_view(name)
                for layer in range(src.shape[0]):
                    dst[layer].index_copy_(0, phys, src[layer].index_select(0, host_pages))
            return op
        assert self.stream is not None
        compute = torch.cuda.current_stream(self.dev.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            idx = phys.to(self.dev.device, non_blocking=True)
            runs = self._dma_runs(host_pages, phys)
            if runs is not None:
                op.layer_events = self._dma_load(runs, overlap, op)
                op.event = torch.cuda.Event()
                op.event.record(self.stream)
                if not overlap:
                    compute.wait_event(op.event)
                return op
            if self.mapped:
                hp = host_pages.to(self.dev.device, non_blocking=True)
                anchor = self.dev.specs[0].name
                for name, src in self.mapped.items():
                    if overlap and name == anchor:
                        continue
                    pages = _gather_pages(src, hp)
                    self.dev.page_bytes_view(name).index_copy_(1, idx, pages)
                    op.keepalive.append(pages)
                if overlap:
                    op.layer_events = self._load_layers(anchor, hp, idx, op)
                op.event = torch.cuda.Event()
                op.event.record(self.stream)
                if not overlap:
                    compute.wait_event(op.event)
                return op
            for name in self.dev.buffers:
                src = self.host.page_bytes_view(name)
                pinned = torch.empty(
                    (src.shape[0], host_pages.numel(), src.shape[2]),
                    dtype=src.dtype,
                    pin_memory=True,
                )
                for layer in range(src.shape[0]):
                    torch.index_select(src[layer], 0, host_pages, out=pinned[layer])
                on_dev = pinned.to(self.dev.device, non_blocking=True)
                self.dev.page_bytes_view(name).index_copy_(1, idx, on_dev)
                op.keepalive += [pinned, on_dev]
            op.event = torch.cuda.Event()
            op.event.record(self.stream)
        compute.wait_event(op.event)
        return op

    def _dma_runs(
        self, host_pages: torch.Tensor, device_pages: torch.Tensor
    ) -> list[tuple[int, int, int]] | None:
        """``(host start, device start, length)`` runs of pages consecutive on both sides, when
        the host pool is layer-first (a layer of a run is then one contiguous block on each
        side) and there are few enough runs for one copy-engine transfer per layer and run to
        beat kernels; else ``None``."""
        if self.host.layout != "layer_first" or not self.host.pinned or host_pages.numel() == 0:
            return None
        h, d = host_pages.cpu(), device_pages.cpu()
        breaks = ((h[1:] - h[:-1] != 1) | (d[1:] - d[:-1] != 1)).nonzero().reshape(-1) + 1
        if breaks.numel() + 1 > max(1, h.numel() // DMA_MIN_RUN):
            return None
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), h.numel()]
        return [(int(h[a]), int(d[a]), b - a) for a, b in zip(starts, ends, strict=True)]

    def _dma_load(
        self, runs: list[tuple[int, int, int]], overlap: bool, op: TransferOp
    ) -> list[torch.cuda.Event] | None:
        """Host → device by copy engine, one transfer per layer and run; the anchor goes last,
        layer by layer, with an event per layer when ``overlap``. Uses no SMs, so it does not
        slow the forward it overlaps."""
        anchor = self.dev.specs[0].name
        names = [n for n in self.dev.buffers if n != anchor] + [anchor]
        events: list[torch.cuda.Event] = []
        for name in names:
            src, dst = self.host.page_bytes_view(name), self.dev.page_bytes_view(name)
            for layer in range(dst.shape[0]):
                for h0, d0, k in runs:
                    dst[layer, d0 : d0 + k].copy_(src[layer, h0 : h0 + k], non_blocking=True)
                if overlap and name == anchor:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    events.append(ev)
        return events or None

    def _load_layers(
        self, name: str, hp: torch.Tensor, idx: torch.Tensor, op: TransferOp
    ) -> list[torch.cuda.Event]:
        """Copy component ``name`` one layer at a time; one event per layer."""
        src, dst = self.mapped[name], self.dev.page_bytes_view(name)
        events = []
        for layer in range(dst.shape[0]):
            pages = src[layer].index_select(0, hp)
            dst[layer].index_copy_(0, idx, pages)
            op.keepalive.append(pages)
            ev = torch.cuda.Event()
            ev.record(self.stream)
            events.append(ev)
        return events


def _scatter_pages(dst: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:, pages] = src`` for ``[layers, pages, words]`` views, writing whole pages
    contiguously when ``dst`` is a page-first buffer seen through a transpose."""
    if dst.stride(0) < dst.stride(1):  # page-first storage
        dst.transpose(0, 1).index_copy_(0, pages, src.transpose(0, 1))
    else:
        dst.index_copy_(1, pages, src)


def _gather_pages(src: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """``src[:, pages]`` as ``[layers, n, words]``, reading page-first storage page by page."""
    if src.stride(0) < src.stride(1):
        return src.transpose(0, 1).index_select(0, pages).transpose(0, 1)
    return src.index_select(1, pages)

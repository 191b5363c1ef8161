"""Device ↔ host page transfers.

Every component of the pool set is seen as rows (one page of one layer; see
``kvtier.transfer.plan``), and a batch is a handful of row copies per component, never a per-page
Python loop: copy-engine block lists, one staging gather/scatter kernel per slice, or one row-copy
kernel through a device view of the pinned host pool, chosen by block size. On CUDA loads and
backups run on two streams of their own (a backup never delays a load) and complete
asynchronously: ``TransferOp.done()`` polls an event without blocking. On CPU copies are
synchronous and ops are born done; the caller's visibility rules are the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.paging import check_whole_pages, pages_to_locs
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import bytes_view
from kvtier.transfer import dma
from kvtier.transfer.mapped import map_pinned
from kvtier.transfer.plan import DIRECT, KERNEL, STAGED, STAGING_BYTES, RowGeometry, choose
from kvtier.transfer.rows import (
    ONE_ROW,
    PCIE_CTAS,
    STAGING_CTAS,
    TILE_WORDS,
    copy_rows,
)
from kvtier.transfer.translate import IdentityTranslator, PageTranslator

log = logging.getLogger(__name__)


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
    paths: dict[str, str] = field(default_factory=dict)
    """Mechanism used per component (``direct``, ``staged``, ``kernel``, ``cpu``, ``unpinned``)."""
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


@dataclass(slots=True)
class _Rows:
    """One component's flat ``[rows, words]`` views and geometry."""

    geo: RowGeometry
    device: torch.Tensor
    host: torch.Tensor
    mapped: torch.Tensor | None


class Mover:
    """Copies pages between one device pool and one host pool."""

    def __init__(
        self,
        device_pool: DevicePool,
        host_pool: HostPool,
        translator: PageTranslator | None = None,
        debug_checks: bool = False,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        self.dev = device_pool
        self.host = host_pool
        self.translator = translator or IdentityTranslator()
        self.debug_checks = debug_checks
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes={staging_bytes} must be positive")
        self.staging_bytes = staging_bytes
        """Device staging memory of one staged component copy (two buffers of half each)."""
        self.cuda = device_pool.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        self.backup_stream = torch.cuda.Stream(device_pool.device) if self.cuda else None
        # Staging gathers and scatters run beside the copy engines on streams of their own.
        self.helpers = (
            {d: torch.cuda.Stream(device_pool.device) for d in ("d2h", "h2d")} if self.cuda else {}
        )
        self.pinned = self.cuda and host_pool.pinned
        self.dma = self.pinned and dma.available()
        self.rows: dict[str, _Rows] = {}
        for spec in device_pool.specs:
            name = spec.name
            dview = device_pool.page_bytes_view(name)
            layers, _, words = dview.shape
            page_dim = 1 if host_pool.layout == "page_first" else 0
            hbuf = host_pool.buffers[name]
            mapped = None
            if self.pinned:
                mapped = bytes_view(
                    map_pinned(hbuf, device_pool.device), page_dim, host_pool.num_pages
                )
                mapped = mapped.reshape(-1, words)
            geo = RowGeometry(
                layers=layers,
                row_bytes=words * dview.element_size(),
                device_pages=device_pool.num_pages,
                host_pages=host_pool.num_pages,
                host_layout=host_pool.layout,
            )
            hview = bytes_view(hbuf, page_dim, host_pool.num_pages).reshape(-1, words)
            self.rows[name] = _Rows(geo, dview.reshape(-1, words), hview, mapped)

    def _check(self, pages: torch.Tensor, what: str) -> None:
        if self.debug_checks:
            check_whole_pages(pages_to_locs(pages, self.dev.page_size), self.dev.page_size, what)

    # -- device → host ------------------------------------------------------------------------

    def device_to_host(self, device_pages: torch.Tensor, host_pages: torch.Tensor) -> TransferOp:
        """Copy device pages into host pages (a backup). The host copy is valid once done."""
        self._check(device_pages, "device_to_host source")
        phys = self.translator.device_physical(device_pages).cpu()
        host_pages = host_pages.cpu()
        op = TransferOp("d2h", phys.numel(), phys.numel() * self.dev.page_bytes)
        if not self.cuda:
            for name, r in self.rows.items():
                copy_rows(r.device, r.geo.device_rows(phys), r.host, r.geo.host_rows(host_pages))
                op.paths[name] = "cpu"
            return op
        stream = self.backup_stream
        assert stream is not None
        finals: list[Callable[[], None]] = []
        with torch.cuda.device(self.dev.device):
            stream.wait_stream(torch.cuda.current_stream(self.dev.device))  # the data's writer
            with torch.cuda.stream(stream):
                for name, r in self.rows.items():
                    final = self._component(name, r, "d2h", host_pages, phys, stream, op)
                    if final is not None:
                        finals.append(final)
                op.event = torch.cuda.Event()
                op.event.record(stream)
        if finals:

            def finalize() -> None:
                for f in finals:
                    f()

            op.finalize = finalize
        return op

    # -- host → device ------------------------------------------------------------------------

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
        phys = self.translator.device_physical(device_pages).cpu()
        host_pages = host_pages.cpu()
        op = TransferOp("h2d", phys.numel(), phys.numel() * self.dev.page_bytes)
        if not self.cuda:
            for name, r in self.rows.items():
                copy_rows(r.host, r.geo.host_rows(host_pages), r.device, r.geo.device_rows(phys))
                op.paths[name] = "cpu"
            return op
        stream = self.load_stream
        assert stream is not None
        overlap = overlap and self.pinned
        anchor = self.dev.specs[0].name
        with torch.cuda.device(self.dev.device):
            compute = torch.cuda.current_stream(self.dev.device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                for name, r in self.rows.items():
                    if not (overlap and name == anchor):
                        self._component(name, r, "h2d", host_pages, phys, stream, op)
                if overlap:
                    op.layer_events = self._load_layers(
                        self.rows[anchor], host_pages, phys, stream, op
                    )
                    op.paths[anchor] += " per layer"
                op.event = torch.cuda.Event()
                op.event.record(stream)
            if not overlap:
                compute.wait_event(op.event)
        return op

    def _load_layers(
        self,
        r: _Rows,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        stream: torch.cuda.Stream,
        op: TransferOp,
    ) -> list[torch.cuda.Event]:
        """Copy one component layer by layer; one event per layer."""
        path = choose(r.geo, "h2d", host_pages, phys, per_layer=True, dma=self.dma)
        op.paths[self.dev.specs[0].name] = path
        events = []
        for layer in range(r.geo.layers):
            if path == DIRECT:
                self._direct(r, "h2d", host_pages, phys, layer, stream)
            else:
                assert r.mapped is not None
                src, dst = r.geo.host_rows(host_pages, layer), r.geo.device_rows(phys, layer)
                self._kernel(r.mapped, src, r.device, dst, op)
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
        return events

    # -- mechanisms ---------------------------------------------------------------------------

    def _component(
        self,
        name: str,
        r: _Rows,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        stream: torch.cuda.Stream,
        op: TransferOp,
    ) -> Callable[[], None] | None:
        """Queue one component's copy by its mechanism; returns the host-side finaliser a
        pageable host pool needs after a d2h copy, else ``None``.

        Should the driver refuse a copy-engine list, copy engines are switched off for this mover
        (with a warning) and the component is copied again by kernel: the rows already queued
        are rewritten with the same bytes, so nothing is lost.
        """
        path = (
            "unpinned"
            if not self.pinned
            else choose(r.geo, direction, host_pages, phys, dma=self.dma)
        )
        if path in (DIRECT, STAGED):
            try:
                if path == DIRECT:
                    self._direct(r, direction, host_pages, phys, None, stream)
                else:
                    self._staged(r, direction, host_pages, phys, stream, op)
                op.paths[name] = path
                return None
            except dma.DmaError as e:
                log.warning("copy engines disabled, transfers fall back to kernels: %s", e)
                self.dma = False
                path = KERNEL
                stream.wait_stream(self.helpers[direction])  # staging work already queued
        op.paths[name] = path
        dev_rows, host_rows = r.geo.device_rows(phys), r.geo.host_rows(host_pages)
        if path == KERNEL:
            assert r.mapped is not None
            if direction == "d2h":
                self._kernel(r.device, dev_rows, r.mapped, host_rows, op)
            else:
                self._kernel(r.mapped, host_rows, r.device, dev_rows, op)
            return None
        if direction == "d2h":
            return self._unpinned_d2h(r, host_pages, phys, op)
        self._unpinned_h2d(r, host_pages, phys, op)
        return None

    def _kernel(
        self,
        src: torch.Tensor,
        src_rows: torch.Tensor,
        dst: torch.Tensor,
        dst_rows: torch.Tensor,
        op: TransferOp,
        ctas: int = PCIE_CTAS,
        tile_words: int = ONE_ROW,
    ) -> None:
        """Row-copy kernel on the current stream (row numbers are moved to the device first).

        Settings, by measurement on an H200 (results/h200-dma): across PCIe one row per program
        per iteration (wider tiles took more from the forward a per-layer load overlaps: TTFT
        107 ms against 89 ms); backup staging gathers alike (a decode step under backups took
        0.97x its time alone, 1.22x with wide tiles); load staging scatters in wide tiles (page
        size 1 loads at 0.84 of a contiguous copy, 0.70 with one row per iteration).
        """
        si = src_rows.to(self.dev.device, non_blocking=True)
        di = dst_rows.to(self.dev.device, non_blocking=True)
        copy_rows(src, si, dst, di, ctas=ctas, tile_words=tile_words)
        op.keepalive += [si, di]

    def _direct(
        self,
        r: _Rows,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        layer: int | None,
        stream: torch.cuda.Stream,
    ) -> None:
        """Copy-engine blocks, one per row (merged where contiguous on both sides)."""
        rb = r.geo.row_bytes
        h = _addresses(r.host, r.geo.host_rows(host_pages, layer), rb)
        d = _addresses(r.device, r.geo.device_rows(phys, layer), rb)
        sizes = np.full(h.size, rb, dtype=np.uint64)
        dst, src = (h, d) if direction == "d2h" else (d, h)
        dma.copy_blocks(*dma.coalesce(dst, src, sizes), stream)

    def _staged(
        self,
        r: _Rows,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        stream: torch.cuda.Stream,
        op: TransferOp,
    ) -> None:
        """Whole host pages by copy engine through two device staging buffers, in slices.

        Staging row ``i * layers + l`` holds layer ``l`` of the slice's page ``i``, so staging page
        ``i`` has the byte layout of a page-first host page and moves as one block. The rows are
        gathered (d2h) or scattered (h2d) on a helper stream, so the copy engine moves one slice
        while the other buffer is filled or emptied:

            d2h   helper: gather k ──> stream: copy k ──> (buffer free) helper: gather k + 2
            h2d   stream: copy k ──> helper: scatter k ──> (buffer free) stream: copy k + 2
        """
        geo = r.geo
        page_bytes = geo.layers * geo.row_bytes
        n = host_pages.numel()
        per_slice = max(1, min(n, self.staging_bytes // (2 * page_bytes)))
        helper = self.helpers[direction]
        helper.wait_stream(stream)  # ``stream`` already follows the compute stream
        slices = range(0, n, per_slice)
        words = r.device.shape[1]
        bufs = [
            torch.empty(
                (per_slice * geo.layers, words), dtype=r.device.dtype, device=self.dev.device
            )
            for _ in range(min(2, len(slices)))
        ]
        op.keepalive += bufs
        freed: list[torch.cuda.Event | None] = [None, None]
        for j, lo in enumerate(slices):
            buf = bufs[j % 2]
            hp, dp = host_pages[lo : lo + per_slice], phys[lo : lo + per_slice]
            k = hp.numel()
            stage_rows = (
                torch.arange(geo.layers)[:, None] + torch.arange(k)[None, :] * geo.layers
            ).reshape(-1)
            host_at = _addresses(r.host, hp, page_bytes)
            stage_at = np.uint64(buf.data_ptr()) + np.arange(k, dtype=np.uint64) * np.uint64(
                page_bytes
            )
            sizes = np.full(k, page_bytes, dtype=np.uint64)
            if direction == "d2h":
                with torch.cuda.stream(helper):
                    if freed[j % 2] is not None:
                        helper.wait_event(freed[j % 2])
                    self._kernel(r.device, geo.device_rows(dp), buf, stage_rows, op, STAGING_CTAS)
                    ready = _record(helper)
                stream.wait_event(ready)
                dma.copy_blocks(*dma.coalesce(host_at, stage_at, sizes), stream)
                freed[j % 2] = _record(stream)
            else:
                if freed[j % 2] is not None:
                    stream.wait_event(freed[j % 2])
                dma.copy_blocks(*dma.coalesce(stage_at, host_at, sizes), stream)
                arrived = _record(stream)
                with torch.cuda.stream(helper):
                    helper.wait_event(arrived)
                    self._kernel(
                        buf, stage_rows, r.device, geo.device_rows(dp), op, STAGING_CTAS, TILE_WORDS
                    )
                    freed[j % 2] = _record(helper)
        if direction == "h2d":
            stream.wait_stream(helper)

    def _unpinned_d2h(
        self, r: _Rows, host_pages: torch.Tensor, phys: torch.Tensor, op: TransferOp
    ) -> Callable[[], None]:
        """Pageable host pool: gather on the device, one copy into pinned memory, scatter on the
        host once the copy is done (the returned finaliser)."""
        di = r.geo.device_rows(phys).to(self.dev.device, non_blocking=True)
        gathered = r.device.index_select(0, di)
        pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        pinned.copy_(gathered, non_blocking=True)
        op.keepalive += [di, gathered]
        hr = r.geo.host_rows(host_pages)

        def scatter() -> None:
            r.host.index_copy_(0, hr, pinned)

        return scatter

    def _unpinned_h2d(
        self, r: _Rows, host_pages: torch.Tensor, phys: torch.Tensor, op: TransferOp
    ) -> None:
        hr = r.geo.host_rows(host_pages)
        pinned = torch.empty((hr.numel(), r.host.shape[1]), dtype=r.host.dtype, pin_memory=True)
        torch.index_select(r.host, 0, hr, out=pinned)
        on_dev = pinned.to(self.dev.device, non_blocking=True)
        di = r.geo.device_rows(phys).to(self.dev.device, non_blocking=True)
        r.device.index_copy_(0, di, on_dev)
        op.keepalive += [pinned, on_dev, di]


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _addresses(rows_view: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> np.ndarray:
    """Byte addresses of ``rows`` of a flat ``[rows, words]`` view (``row_bytes`` apart)."""
    base = np.uint64(rows_view.data_ptr())
    return base + rows.numpy().astype(np.uint64) * np.uint64(row_bytes)

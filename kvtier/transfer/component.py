"""One component's rows in both pools, and the mechanisms that copy them.

A row is one page of one layer (``kvtier.transfer.plan`` has the row table and picks the
mechanism); this module only carries out the pick. Everything here queues work on the current
CUDA stream (or the streams passed in) and never waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import bytes_view
from kvtier.transfer import dma
from kvtier.transfer.mapped import map_pinned
from kvtier.transfer.op import TransferOp
from kvtier.transfer.plan import RowGeometry, staging_slices
from kvtier.transfer.rows import ONE_BLOCK, PCIE_CTAS, STAGING_CTAS, TILE_WORDS, copy_rows


@dataclass(slots=True)
class ComponentRows:
    """Flat ``[rows, words]`` views of one component in the device pool, the host pool and
    (pinned host pools on CUDA) the device view of the host pool."""

    geo: RowGeometry
    device: torch.Tensor
    host: torch.Tensor
    mapped: torch.Tensor | None

    @classmethod
    def of(cls, dev: DevicePool, host: HostPool, name: str, mapped: bool) -> ComponentRows:
        dview = dev.page_bytes_view(name)
        layers, _, words = dview.shape
        page_dim = 1 if host.layout == "page_first" else 0
        hbuf = host.buffers[name]
        geo = RowGeometry(
            layers=layers,
            row_bytes=words * dview.element_size(),
            device_pages=dev.num_pages,
            host_pages=host.num_pages,
            host_layout=host.layout,
        )
        view = None
        if mapped:
            view = bytes_view(map_pinned(hbuf, dev.device), page_dim, host.num_pages)
            view = view.reshape(-1, words)
        hview = bytes_view(hbuf, page_dim, host.num_pages).reshape(-1, words)
        return cls(geo, dview.reshape(-1, words), hview, view)

    def _ends(
        self, direction: str, host_pages: torch.Tensor, phys: torch.Tensor, layer: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(src, src_rows, dst, dst_rows)`` through the device view of the host pool."""
        h, d = self.geo.host_rows(host_pages, layer), self.geo.device_rows(phys, layer)
        assert self.mapped is not None
        if direction == "d2h":
            return self.device, d, self.mapped, h
        return self.mapped, h, self.device, d

    def cpu(self, direction: str, host_pages: torch.Tensor, phys: torch.Tensor) -> None:
        """Synchronous copy between CPU tensors."""
        h, d = self.geo.host_rows(host_pages), self.geo.device_rows(phys)
        if direction == "d2h":
            copy_rows(self.device, d, self.host, h)
        else:
            copy_rows(self.host, h, self.device, d)

    def kernel(
        self,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        op: TransferOp,
        layer: int | None = None,
    ) -> None:
        """Row kernel across PCIe (all layers, or one)."""
        queue_rows(*self._ends(direction, host_pages, phys, layer), op)

    def direct(
        self,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        stream: torch.cuda.Stream,
        layer: int | None = None,
    ) -> None:
        """Copy-engine blocks, one per row (merged where contiguous on both sides)."""
        rb = self.geo.row_bytes
        h = _addresses(self.host, self.geo.host_rows(host_pages, layer), rb)
        d = _addresses(self.device, self.geo.device_rows(phys, layer), rb)
        sizes = np.full(h.size, rb, dtype=np.uint64)
        dst, src = (h, d) if direction == "d2h" else (d, h)
        dma.copy_blocks(*dma.coalesce(dst, src, sizes), stream)

    def staged(
        self,
        direction: str,
        host_pages: torch.Tensor,
        phys: torch.Tensor,
        stream: torch.cuda.Stream,
        helper: torch.cuda.Stream,
        staging_bytes: int,
        op: TransferOp,
    ) -> None:
        """Whole host pages by copy engine through two device staging buffers, in slices.

        Staging row ``i * layers + l`` holds layer ``l`` of the slice's page ``i``, so staging page
        ``i`` has the byte layout of a page-first host page and moves as one block. The rows are
        gathered (d2h) or scattered (h2d) on ``helper``, so the copy engine moves one slice while
        the other buffer is filled or emptied:

            d2h   helper: gather k ──> stream: copy k ──> (buffer free) helper: gather k + 2
            h2d   stream: copy k ──> helper: scatter k ──> (buffer free) stream: copy k + 2
        """
        geo = self.geo
        page_bytes = geo.layers * geo.row_bytes
        sizes_in_pages = staging_slices(host_pages.numel(), page_bytes, staging_bytes, direction)
        helper.wait_stream(stream)  # ``stream`` already follows the compute stream
        words, dtype, device = self.device.shape[1], self.device.dtype, self.device.device
        largest = max(sizes_in_pages)
        bufs = [
            torch.empty((largest * geo.layers, words), dtype=dtype, device=device)
            for _ in range(min(2, len(sizes_in_pages)))
        ]
        op.keepalive += bufs
        freed: list[torch.cuda.Event | None] = [None, None]
        lo = 0
        for j, k in enumerate(sizes_in_pages):
            buf = bufs[j % 2]
            hp, dp = host_pages[lo : lo + k], phys[lo : lo + k]
            lo += k
            stage_rows = (
                torch.arange(geo.layers)[:, None] + torch.arange(k)[None, :] * geo.layers
            ).reshape(-1)
            host_at = _addresses(self.host, hp, page_bytes)
            stage_at = np.uint64(buf.data_ptr()) + np.arange(k, dtype=np.uint64) * np.uint64(
                page_bytes
            )
            sizes = np.full(k, page_bytes, dtype=np.uint64)
            if direction == "d2h":
                with torch.cuda.stream(helper):
                    if freed[j % 2] is not None:
                        helper.wait_event(freed[j % 2])
                    queue_rows(self.device, geo.device_rows(dp), buf, stage_rows, op, STAGING_CTAS)
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
                    queue_rows(
                        buf,
                        stage_rows,
                        self.device,
                        geo.device_rows(dp),
                        op,
                        STAGING_CTAS,
                        TILE_WORDS,
                    )
                    freed[j % 2] = _record(helper)
        if direction == "h2d":
            stream.wait_stream(helper)

    def unpinned(
        self, direction: str, host_pages: torch.Tensor, phys: torch.Tensor, op: TransferOp
    ) -> Callable[[], None] | None:
        """Pageable host pool: through a pinned temporary. d2h gathers on the device, copies into
        pinned memory and returns the host-side scatter to run once the copy is done."""
        device = self.device.device
        hr = self.geo.host_rows(host_pages)
        di = self.geo.device_rows(phys).to(device, non_blocking=True)
        if direction == "d2h":
            gathered = self.device.index_select(0, di)
            pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            pinned.copy_(gathered, non_blocking=True)
            op.keepalive += [di, gathered]

            def scatter() -> None:
                self.host.index_copy_(0, hr, pinned)

            return scatter
        pinned = torch.empty(
            (hr.numel(), self.host.shape[1]), dtype=self.host.dtype, pin_memory=True
        )
        torch.index_select(self.host, 0, hr, out=pinned)
        on_dev = pinned.to(device, non_blocking=True)
        self.device.index_copy_(0, di, on_dev)
        op.keepalive += [pinned, on_dev, di]
        return None


def queue_rows(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    op: TransferOp,
    ctas: int = PCIE_CTAS,
    tile_words: int = ONE_BLOCK,
) -> None:
    """Row-copy kernel on the current stream (row numbers are moved to the device first).

    Settings, by measurement on an H200 (results/h200-dma): across PCIe one row per program per
    iteration (wider tiles took more from the forward a per-layer load overlaps: TTFT 107 ms
    against 89 ms); backup staging gathers alike (a decode step under backups took 0.97x its time
    alone, 1.22x with wide tiles); load staging scatters in wide tiles (page size 1 loads at 0.84
    of a contiguous copy, 0.70 with one row per iteration).
    """
    si = src_rows.to(src.device, non_blocking=True)
    di = dst_rows.to(src.device, non_blocking=True)
    copy_rows(src, si, dst, di, ctas=ctas, tile_words=tile_words)
    op.keepalive += [si, di]


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _addresses(rows_view: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> np.ndarray:
    """Byte addresses of ``rows`` of a flat ``[rows, words]`` view (``row_bytes`` apart)."""
    base = np.uint64(rows_view.data_ptr())
    return base + rows.numpy().astype(np.uint64) * np.uint64(row_bytes)

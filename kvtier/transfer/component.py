"""One component's rows in both pools, and the mechanisms that copy them.

A row is one page of one layer (``kvtier.transfer.plan`` has the row table and picks the
mechanism); this module only carries out the pick. Everything here queues work on the current
CUDA stream (or the streams passed in) and never waits for the GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import IntegrityError
from kvtier.pools.codec import CODECS, SCALE_SUFFIX, PageCodec
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec, bytes_view
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer import dma
from kvtier.transfer.chunks import queue_all
from kvtier.transfer.mapped import map_pinned
from kvtier.transfer.op import TransferOp
from kvtier.transfer.page_lists import PageLists
from kvtier.transfer.plan import RowGeometry, staging_slices
from kvtier.transfer.rows import (
    FALLBACK_TEMP_BYTES,
    ONE_BLOCK,
    PCIE_CTAS,
    STAGING_CTAS,
    TILE_WORDS,
    compile_kernels,
    copy_page_rows,
    copy_rows,
)
from kvtier.transfer.staged_blocks import slice_blocks
from kvtier.transfer.streams import on, recorded


@dataclass(slots=True)
class ComponentRows:
    """Flat ``[rows, words]`` views of one component in the device pool, the host pool and
    (pinned host pools on CUDA) the device view of the host pool."""

    geo: RowGeometry
    device: torch.Tensor
    host: torch.Tensor
    mapped: torch.Tensor | None

    @classmethod
    def of(
        cls, dev: DevicePool | UnifiedPool, host: HostPool, name: str, mapped: bool
    ) -> ComponentRows:
        """Rows of component ``name``; in a unified arena every component reads the same
        ``[units, words]`` view and a physical page is a base unit (layer stride 1)."""
        flat, layers, pages, stride = device_rows_view(dev, name)
        words = flat.shape[1]
        if isinstance(host, UnifiedPool):  # a relocatable host arena: rows are its units
            return cls._of_arena(flat, host, layers, pages, stride, dev.device, mapped)
        page_dim = 1 if host.layout == "page_first" else 0
        hbuf = host.buffers[name]
        geo = RowGeometry(
            layers=layers,
            row_bytes=words * flat.element_size(),
            device_pages=pages,
            host_pages=host.num_pages,
            host_layout=host.layout,
            device_layer_stride=stride,
        )
        view = None
        if mapped:
            view = bytes_view(map_pinned(hbuf, dev.device), page_dim, host.num_pages)
            view = view.reshape(-1, words)
        hview = bytes_view(hbuf, page_dim, host.num_pages).reshape(-1, words)
        if hview.dtype != flat.dtype:
            raise IntegrityError(f"component {name!r}: device and host rows have other words")
        return cls(geo, flat, hview, view)

    @classmethod
    def _of_arena(
        cls,
        flat: torch.Tensor,
        host: UnifiedPool,
        layers: int,
        pages: int,
        stride: int,
        device: torch.device,
        mapped: bool,
    ) -> ComponentRows:
        hview = host.unit_words()
        if hview.dtype != flat.dtype or hview.shape[1] != flat.shape[1]:
            raise IntegrityError("device and host arena rows have other words")
        geo = RowGeometry(
            layers=layers,
            row_bytes=flat.shape[1] * flat.element_size(),
            device_pages=pages,
            host_pages=host.slots,
            host_layout=host.layout,
            device_layer_stride=stride,
            host_layer_stride=host.stride,
        )
        view = None
        if mapped:
            view = map_pinned(host.arena, device).view(-1).view(hview.dtype).view(hview.shape)
        return cls(geo, flat, hview, view)

    def warm_up(self) -> None:
        """Compile the row kernels this component's copies use (``rows.compile_kernels``) and
        launch once the torch kernels that build its row lists on the GPU (``arange``, the
        stride multiply and the broadcast add of :meth:`RowGeometry.device_rows`), so that no
        transfer waits for either.

        Why the launch: CUDA loads a kernel's module at its first launch (lazy loading, the
        default), and the first transfer by row kernel, a small one that came after the large
        ones had staged, spent 0.03-0.06 s loading those three on an H200
        (``results/h200-dma/jit_variants.py --kernels``, ``results/h200-dma/run19/``)."""
        geo = self.geo
        compile_kernels(
            self.device.shape[1],
            self.device.dtype,
            self.device.device,
            geo.layers,
            geo.host_layout == "layer_first",
            staged=not geo.envelope,  # an envelope's pages are never staged
        )
        first = torch.zeros(1, dtype=torch.int64, device=self.device.device)
        for page_major in (False, True):
            geo.device_rows(first, page_major=page_major)
            geo.host_rows(first, page_major=page_major)

    def cpu(self, direction: str, pages: PageLists) -> None:
        """Synchronous copy between CPU tensors."""
        h, d = self.geo.host_rows(pages.host), self.geo.device_rows(pages.device)
        self.copy(direction, h, d)

    def copy(
        self, direction: str, h: torch.Tensor, d: torch.Tensor, op: TransferOp | None = None
    ) -> None:
        """Queue the copy of device rows ``d`` and host rows ``h`` in one go (on the rows'
        device; on CUDA on the current stream by row kernel through the device view of the
        pinned host pool, ``op`` keeping the row lists): what a per-layer backup queues for a
        layer."""
        if not self.device.is_cuda:
            src, si, dst, di = (
                (self.device, d, self.host, h)
                if direction == "d2h"
                else (self.host, h, self.device, d)
            )
            copy_rows(src, si, dst, di)
            return
        if self.mapped is None or op is None:
            raise IntegrityError("a row copy on CUDA without a mapped host pool or its op")
        src, si, dst, di = (
            (self.device, d, self.mapped, h)
            if direction == "d2h"
            else (self.mapped, h, self.device, d)
        )
        queue_rows(src, si, dst, di, op)

    def kernel(
        self, direction: str, pages: PageLists, op: TransferOp, chunk: int = 0
    ) -> Iterator[int]:
        """Row kernel across PCIe through the device view of the host pool. A generator of
        chunks (see ``kvtier.transfer.pacer``): yields a launch's bytes, then queues it when
        resumed; one launch for all rows, or launches of about ``chunk`` bytes."""
        if self.mapped is None:
            raise IntegrityError(
                "row kernel across PCIe without a device view of the host pool (pageable host "
                "pool or CPU device)"
            )
        hg, dg = pages.on_gpu(self.device.device, op)
        h, d = self.geo.host_rows(hg), self.geo.device_rows(dg)
        src, si, dst, di = (
            (self.device, d, self.mapped, h)
            if direction == "d2h"
            else (self.mapped, h, self.device, d)
        )
        n, rb = si.numel(), self.geo.row_bytes
        step = n if chunk <= 0 else max(1, chunk // rb)
        for lo in range(0, n, step):
            yield (min(n, lo + step) - lo) * rb
            queue_rows(src, si[lo : lo + step], dst, di[lo : lo + step], op)

    def kernel_layers(
        self, direction: str, pages: PageLists, op: TransferOp, after_layer: Callable[[], None]
    ) -> None:
        """Like :meth:`kernel`, one launch per layer, each followed by ``after_layer()``."""
        chunk = pages.host.numel() * self.geo.row_bytes
        queue_all(self.kernel(direction, pages, op, chunk), after_layer)

    def direct(
        self,
        direction: str,
        pages: PageLists,
        stream: torch.cuda.Stream,
        layer: int | None = None,
        chunk: int = 0,
    ) -> Iterator[int]:
        """Copy-engine blocks, one per row (merged where contiguous on both sides). A generator
        of chunks (see :meth:`kernel`): one block list, or lists of about ``chunk`` bytes."""
        rb, geo = self.geo.row_bytes, self.geo
        # Page-major where a page's layers are contiguous on both sides: they coalesce.
        major = geo.whole_pages and layer is None
        h = _addresses(self.host, geo.host_rows(pages.host, layer, major), rb)
        d = _addresses(self.device, geo.device_rows(pages.device, layer, major), rb)
        sizes = np.full(h.size, rb, dtype=np.uint64)
        dst, src = (h, d) if direction == "d2h" else (d, h)
        dst, src, sizes = dma.coalesce(dst, src, sizes)
        ends = np.cumsum(sizes)
        lo = 0
        while lo < sizes.size:
            hi = sizes.size
            if chunk > 0:
                hi = max(lo + 1, int(np.searchsorted(ends, ends[lo] - sizes[lo] + chunk, "right")))
            yield int(ends[hi - 1] - ends[lo] + sizes[lo])
            dma.copy_blocks(dst[lo:hi], src[lo:hi], sizes[lo:hi], stream)
            lo = hi

    def staged(
        self,
        direction: str,
        pages: PageLists,
        stream: torch.cuda.Stream,
        helper: torch.cuda.Stream,
        staging_bytes: int,
        op: TransferOp,
    ) -> Iterator[int]:
        """Host pages by copy engine through two device staging buffers, in slices
        (``plan.staging_slices``). A generator of chunks (see :meth:`kernel`), one per slice.

        A slice's staging buffer has the byte layout of its host pages laid side by side, so a
        run of consecutive host pages is one copy-engine block (per layer for a layer-first
        host; ``kvtier.transfer.staged_blocks``). The rows are gathered (d2h) or scattered (h2d) on
        ``helper`` by one launch per slice that reads the slice's device pages
        (``rows.copy_page_rows``), so the copy engine moves one slice while the other buffer is
        filled or emptied:

            d2h   helper: gather k ──> stream: copy k ──> (buffer free) helper: gather k + 2
            h2d   stream: copy k ──> helper: scatter k ──> (buffer free) stream: copy k + 2

        An h2d scatter is queued after the next slice's copy, so that copy is never queued
        behind it on the CPU.
        """
        geo = self.geo
        layers, page_bytes = geo.layers, geo.layers * geo.row_bytes
        n = pages.host.numel()
        slices = staging_slices(n, page_bytes, staging_bytes, direction, op.shared_link)
        words, dtype, device = self.device.shape[1], self.device.dtype, self.device.device
        largest = max(slices)
        bufs = [
            torch.empty((largest * layers, words), dtype=dtype, device=device)
            for _ in range(min(2, len(slices)))
        ]
        op.keepalive += bufs
        blocks = slice_blocks(
            pages.host.numpy(), pages.host_breaks(), slices, geo, self.host.data_ptr()
        )
        single_upto = dma.FEW_BLOCKS if op.shared_link else 0
        los = [0, *itertools.accumulate(slices)]
        freed: list[torch.cuda.Event | None] = [None, None]
        if direction == "d2h":
            # The device page list goes up before the first gather, which needs it.
            dev_pages = pages.device_on_gpu(device, op)
            # After the list and what ``stream`` followed before it (the compute stream), not
            # after the copies of the components before this one.
            helper.wait_event(pages.device_listed)
            for j, k in enumerate(slices):
                buf, b, lo = bufs[j % 2], j % 2, los[j]
                host_at, at, sizes = next(blocks)
                with on(helper):
                    if freed[b] is not None:
                        helper.wait_event(freed[b])
                    # The first gather runs alone: all programs, so the copy engine starts soon.
                    ctas = PCIE_CTAS if j == 0 else STAGING_CTAS
                    self.stage(buf, dev_pages[lo : lo + k], True, op, ctas, ONE_BLOCK)
                    ready = recorded(helper)
                stream.wait_event(ready)
                yield k * page_bytes
                dma.copy_blocks(host_at, at + buf.data_ptr(), sizes, stream, single_upto)
                freed[b] = recorded(stream)
            return
        helper.wait_stream(stream)  # ``stream`` follows the compute stream
        arrived: list[torch.cuda.Event] = []

        def scatter(j: int, dev_pages: torch.Tensor) -> None:
            # Queued after the next slice's copy, so that copy goes out first.
            with on(helper):
                helper.wait_event(arrived[j])
                lo, k, b = los[j], slices[j], j % 2
                self.stage(bufs[b], dev_pages[lo : lo + k], False, op, STAGING_CTAS, TILE_WORDS)
                freed[b] = recorded(helper)

        for j, k in enumerate(slices):
            buf, b = bufs[j % 2], j % 2
            host_at, at, sizes = next(blocks)
            if freed[b] is not None:
                stream.wait_event(freed[b])
            yield k * page_bytes
            dma.copy_blocks(at + buf.data_ptr(), host_at, sizes, stream, single_upto)
            # The first call uploads it behind the first copy on ``stream``: up as that copy
            # ends, which is when the first scatter needs it (a copy engine would queue it
            # there anyway).
            dev_pages = pages.device_on_gpu(device, op)
            arrived.append(recorded(stream))
            if j:
                scatter(j - 1, dev_pages)
        # ``stream`` joins ``helper`` once the whole load is queued (``Mover._load_chunks``).
        scatter(len(slices) - 1, pages.device_on_gpu(device, op))

    def stage(
        self,
        buf: torch.Tensor,
        dev_pages: torch.Tensor,
        gather: bool,
        op: TransferOp,
        ctas: int,
        tile_words: int,
    ) -> None:
        """Gather the rows of ``dev_pages`` into staging ``buf`` page-major, or scatter them
        back, on the current stream."""
        src, dst = (self.device, buf) if gather else (buf, self.device)
        geo = self.geo
        copy_page_rows(
            src,
            dst,
            dev_pages,
            geo.layers,
            geo.layer_stride,
            gather,
            ctas,
            tile_words,
            layer_major=geo.host_layout == "layer_first",
        )
        op.keepalive.append(dev_pages)

    def unpinned(
        self, direction: str, pages: PageLists, op: TransferOp
    ) -> Callable[[], None] | None:
        """Pageable host pool: through a pinned temporary. d2h gathers on the device, copies into
        pinned memory and returns the host-side scatter to run once the copy is done."""
        device = self.device.device
        hr = self.geo.host_rows(pages.host)
        di = self.geo.device_rows(pages.device).to(device, non_blocking=True)
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


def device_rows_view(
    dev: DevicePool | UnifiedPool, name: str
) -> tuple[torch.Tensor, int, int, int]:
    """``(flat, layers, pages, layer stride)`` of component ``name`` on the device: its flat
    ``[rows, words]`` view (a unified arena's ``[units, words]``, shared by every component),
    its layers, the device pages (base units in an arena) and the device layer stride
    (``RowGeometry.device_layer_stride``)."""
    if isinstance(dev, UnifiedPool):
        flat = dev.unit_words()
        return flat, dev.specs[dev.component(name)].num_layers, dev.units, 1
    dview = dev.page_bytes_view(name)
    layers, _, words = dview.shape
    return dview.reshape(-1, words), layers, dev.num_pages, 0


CODED_TEMP_BYTES = 32 << 20
"""Largest float32 temporary of one coded chunk on CUDA (the chunk's device memory peaks at
about five times this: the gathered rows, three float32 steps of the scaling, the codes):
each chunk is a handful of kernel launches (gather, scale, cast, two row copies), so chunks
are large enough that launches do not bound a copy of GiBs (``FALLBACK_TEMP_BYTES`` bounds
them on CPU, where large temporaries cost page faults)."""


@dataclass(slots=True)
class CodedRows:
    """A lossy component held in coded form in the host pool (``kvtier.pools.codec``): rows
    are quantized on their way to the host and dequantized on their way back, on the device
    that holds the device pool. The row numbers are those of :class:`ComponentRows` (one row is
    one page of one layer), the host codes and scales being laid out alike.

    ``device`` is ``[device rows, row elements of a page]`` in the device element type,
    ``codes`` ``[host rows, row words]`` (the codec's one-byte elements as 4-byte words where a
    row's bytes allow, else as bytes), ``scales`` ``[host rows, groups]`` float32. On CUDA
    ``mapped_codes`` and ``mapped_scales`` are device views of the pinned host rows: the link
    carries the coded bytes, and the host never touches a row."""

    geo: RowGeometry
    spec: PoolSpec
    codec: PageCodec
    device: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    mapped_codes: torch.Tensor | None = None
    mapped_scales: torch.Tensor | None = None

    @classmethod
    def of(
        cls, dev: DevicePool | UnifiedPool, host: HostPool, spec: PoolSpec, mapped: bool = False
    ) -> CodedRows:
        """Rows of coded component ``spec`` (a device spec) between ``dev`` and ``host``;
        ``mapped``: a pinned host pool on CUDA (rows cross by kernel through its device view)."""
        flat, layers, pages, stride = device_rows_view(dev, spec.name)
        r = spec.rows_per_page(host.page_size)
        numel = r * spec.row_numel
        device = flat.view(torch.uint8).view(spec.dtype)
        if device.shape[1] != numel:
            raise IntegrityError(
                f"component {spec.name!r}: a device row holds {device.shape[1]} elements, a "
                f"coded host row {numel}"
            )
        # Raw words: index ops and row kernels do not take float8 tensors.
        word = torch.int32 if numel % 4 == 0 else torch.uint8
        hcodes, hscales = host.buffers[spec.name], host.buffers[spec.name + SCALE_SUFFIX]
        geo = RowGeometry(
            layers=layers,
            row_bytes=numel * spec.dtype.itemsize,
            device_pages=pages,
            host_pages=host.num_pages,
            host_layout=host.layout,
            device_layer_stride=stride,
        )
        rows = cls(geo, spec, host.codec, device, *_coded_views(hcodes, hscales, word))
        if mapped:
            views = _coded_views(
                map_pinned(hcodes, dev.device), map_pinned(hscales, dev.device), word
            )
            rows.mapped_codes, rows.mapped_scales = views
        return rows

    def warm_up(self) -> None:
        """Compile the row kernels of the coded rows and scales (see
        :meth:`ComponentRows.warm_up`)."""
        for t in (self.codes, self.scales):
            compile_kernels(
                t.shape[1], t.dtype, self.device.device, self.geo.layers, False, staged=False
            )

    def cpu(self, direction: str, pages: PageLists) -> None:
        """Synchronous coded copy between CPU tensors: ``d2h`` encodes, ``h2d`` decodes."""
        h, d = self.geo.host_rows(pages.host), self.geo.device_rows(pages.device)
        self.copy(direction, h, d)

    def copy(
        self, direction: str, h: torch.Tensor, d: torch.Tensor, op: TransferOp | None = None
    ) -> None:
        """Queue the coded copy of device rows ``d`` and host rows ``h`` (on the rows'
        device; on CUDA on the current stream, through the device views of the pinned host
        rows) in one go: what a per-layer backup queues for a layer. ``op`` is not needed:
        every temporary lives on the current stream (:meth:`_chunks`)."""
        queue_all(self._chunks(direction, h, d))

    def kernel(self, direction: str, pages: PageLists, op: TransferOp) -> Iterator[int]:
        """The coded copy on CUDA, on the current stream, through the device views of the
        pinned host rows. A generator of chunks (see :meth:`ComponentRows.kernel`)."""
        hg, dg = pages.on_gpu(self.device.device, op)
        yield from self._chunks(direction, self.geo.host_rows(hg), self.geo.device_rows(dg))

    def _targets(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(codes, scales, temporary bytes)`` a copy on the device pool's device goes
        through: the device views of the pinned host rows on CUDA, the host rows on CPU."""
        if not self.device.is_cuda:
            return self.codes, self.scales, FALLBACK_TEMP_BYTES
        if self.mapped_codes is None or self.mapped_scales is None:
            raise IntegrityError(
                f"coded copy of {self.spec.name!r} on CUDA without a device view of the host "
                "pool (a pageable host pool)"
            )
        return self.mapped_codes, self.mapped_scales, CODED_TEMP_BYTES

    def _chunks(self, direction: str, h: torch.Tensor, d: torch.Tensor) -> Iterator[int]:
        """Rows ``d`` of the device coded into host rows ``h`` (``d2h``), or back (``h2d``),
        through :meth:`_targets`, in chunks of bounded float32 temporaries. Yields a chunk's
        coded bytes, then queues it when resumed.

        On CUDA every temporary is made and used on the current stream only, so it is freed
        as soon as it is queued: the caching allocator hands its memory out again only to work
        queued after it on that stream."""
        spec, codec = self.spec, self.codec
        codes, scales, temp_bytes = self._targets()
        numel = self.device.shape[1]
        step = max(1, temp_bytes // (numel * 4))
        n = h.numel()
        for lo in range(0, n, step):
            hi, di = h[lo : lo + step], d[lo : lo + step]
            k = hi.numel()
            yield k * (codes.shape[1] * codes.element_size() + scales.shape[1] * 4)
            at = torch.arange(k, device=hi.device)
            if direction == "d2h":
                x = self.device.index_select(0, di)
                coded, scale = codec.encode(x.view(k, -1, spec.row_numel), spec)
                words = coded.view(torch.uint8).view(k, -1).view(codes.dtype)
                copy_rows(words, at, codes, hi, ctas=PCIE_CTAS)
                copy_rows(scale, at, scales, hi, ctas=PCIE_CTAS)
            else:
                words = torch.empty((k, codes.shape[1]), dtype=codes.dtype, device=hi.device)
                scale = torch.empty((k, scales.shape[1]), dtype=scales.dtype, device=hi.device)
                copy_rows(codes, hi, words, at, ctas=PCIE_CTAS)
                copy_rows(scales, hi, scale, at, ctas=PCIE_CTAS)
                coded = words.view(torch.uint8).view(codec.dtype).view(k, -1, spec.row_numel)
                x = codec.decode(coded, scale, spec).view(k, numel)
                self.device.index_copy_(0, di, x)


def _coded_views(
    codes: torch.Tensor, scales: torch.Tensor, word: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``[host rows, row words]`` views of a coded component's host buffer and of its
    scale sidecar's ``[host rows, groups]``."""
    rows = scales.numel() // scales.shape[-1]
    return codes.view(torch.uint8).view(rows, -1).view(word), scales.view(rows, -1)


def component_rows(
    dev: DevicePool | UnifiedPool, host: HostPool, pinned: bool
) -> dict[str, ComponentRows | CodedRows]:
    """Every component's rows, in pool order; with a ``pinned`` host pool (on CUDA) each has a
    device view of its host rows and its kernels compiled and loaded (rows cross PCIe by kernel,
    or stage, only from a pinned pool). A component the host pool's codec holds coded gets
    :class:`CodedRows`."""
    codec = getattr(host, "codec", CODECS["none"])  # a host arena holds every component exactly
    rows: dict[str, ComponentRows | CodedRows] = {}
    for s in dev.specs:
        if codec.codes(s):
            rows[s.name] = CodedRows.of(dev, host, s, mapped=pinned)
        else:
            rows[s.name] = ComponentRows.of(dev, host, s.name, mapped=pinned)
    if pinned:
        for r in rows.values():
            r.warm_up()
    return rows


def queue_rows(
    src: torch.Tensor,
    src_rows: torch.Tensor,
    dst: torch.Tensor,
    dst_rows: torch.Tensor,
    op: TransferOp,
    ctas: int = PCIE_CTAS,
    tile_words: int = ONE_BLOCK,
) -> None:
    """Row-copy kernel on the current stream (row numbers already on the GPU).

    Settings, by measurement on an H200 (results/h200-dma): across PCIe one block per program per
    iteration (wider tiles took more from the forward a per-layer load overlaps: TTFT 107 ms
    against 89 ms); backup staging gathers alike (a decode step under backups took 0.97x its time
    alone, 1.22x with wide tiles); load staging scatters in wide tiles (page size 1 loads at 0.84
    of a contiguous copy, 0.70 with one row per iteration).
    """
    copy_rows(src, src_rows, dst, dst_rows, ctas=ctas, tile_words=tile_words)
    op.keepalive += [src_rows, dst_rows]


def _addresses(rows_view: torch.Tensor, rows: torch.Tensor, row_bytes: int) -> np.ndarray:
    """Byte addresses of ``rows`` of a flat ``[rows, words]`` view (``row_bytes`` apart)."""
    base = np.uint64(rows_view.data_ptr())
    return base + rows.numpy().astype(np.uint64) * np.uint64(row_bytes)

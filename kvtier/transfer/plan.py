"""Row geometry of one component and the choice of copy mechanism.

A *row* is one page of one layer of one component: ``row_bytes`` contiguous bytes in every pool.
Row numbers in each pool's flat ``[rows, words]`` view:

    pool                      row of (layer l, page p)    neighbours in memory
    device (layer-first)      l * device_pages + p        pages of one layer
    device (unified arena)    p + l  (p = base unit)      layers of one page (its envelope)
    host page_first           p * layers + l              layers of one page
    host layer_first          l * host_pages + p          pages of one layer

Mechanisms, by measurement on an H200 (see ``kvtier.transfer.dma`` and ``kvtier.transfer.rows``):

    direct   one copy-engine block per row (or run of rows contiguous on both sides)
    staged   host pages by copy engine into / out of a device staging buffer laid out as they
             are on the host, rows gathered / scattered on the device; a run of consecutive host
             pages (one tree node's backup) is one block, of all layers (page_first) or per
             layer (layer_first)
    kernel   rows copied by a kernel through a device view of pinned host memory

Copy engines use no SMs (nothing the transfer overlaps slows down), so they win whenever their
blocks are large enough to run at link speed; kernels take the small-block cases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

H2D_DMA_MIN_BYTES = 64 << 10
"""Smallest mean copy-engine block for host → device: 0.97 of a contiguous copy at 64 KiB,
0.88 at 32 KiB (kernels: 0.89-0.92 at every size)."""
D2H_DMA_MIN_BYTES = 256 << 10
"""Smallest mean copy-engine block for device → host: 0.97 at 256 KiB, 0.88 at 64 KiB
(kernels: 0.91-0.95)."""
SHARED_D2H_DMA_MIN_BYTES = 64 << 10
"""The same beside a host → device copy (``Mover.exchange``). Both ways at once through
``exchange`` with random host pages at page size 1 on an H200 (``results/h200-dma/run14/``,
``results/h200-dma/mix_page1.py``, two machines), as fractions of two contiguous copies:

    pages                    d2h staged + h2d kernel   d2h kernel + h2d staged   staged both
    70-86 KiB (MLA, DSA)     0.65-0.79                 0.54-0.68                 0.41-0.54
    128 KiB (dense, SWA)     0.72-0.82                 0.58-0.65                 0.70-0.88

Where blocks are small, the copy engine takes the backup and a row kernel the load
(``SHARED_H2D_DMA_MIN_BYTES``); from 96 KiB both directions go by copy engine."""
SHARED_H2D_DMA_MIN_BYTES = 96 << 10
"""Smallest mean copy-engine block for host → device beside a device → host copy: under it the
load goes by row kernel and leaves the copy engines to the backup (see above). Between the
pages above and 120 KiB: DSA at page size 1 with a layer-first host, whose 256-byte indexer
rows make 120 KiB blocks per layer and host run beside the latent cache's staged copies, moved
0.938 / 0.945 (best / median) of two contiguous copies with its load staged, 0.883-0.891 /
0.902-0.913 with it by kernel (``results/h200-dma/run18/``, ``results/h200-dma/dsa_index_mix.py``)."""
STAGING_BYTES = 256 << 20
"""Device staging per staged transfer; larger batches go through it in slices."""
FIRST_SLICE_BYTES = 16 << 20
"""First staging slice of a d2h copy (last of an h2d copy): the one no copy engine overlaps. Large
enough that its copy outlasts the CPU issuing the next slice (about 0.2 ms: smaller first slices
left the copy engine waiting for the CPU), small enough to gather in tens of microseconds with
``rows.PCIE_CTAS`` programs."""
SHARED_FIRST_SLICE_BYTES = 32 << 20
"""The same where a copy the other way shares the link (``Mover.exchange``): the CPU sets up that
copy between this one's first and second slices. With 16 MiB first slices the backup's copy
engine then sat idle for 0.3-1.1 ms after its first copy in every family on an H200
(``results/h200-dma/run16/exchange_gaps_before.json``, ``exchange_gaps_order_before.json``);
with 32 MiB, 0-0.52 ms (``exchange_gaps_order_a.json``, ``exchange_gaps_order_b.json``)."""

STAGE_GAIN = 8
"""Staging is chosen over direct blocks when its blocks are this many times larger (page-first
host; a multi-layer layer-first host stages whenever its blocks are no smaller, see
:func:`choose`)."""

KERNEL, DIRECT, STAGED = "kernel", "direct", "staged"


@dataclass(frozen=True, slots=True)
class RowGeometry:
    """Where the rows of one component live in the device and host pools."""

    layers: int
    """Layers of the component."""
    row_bytes: int
    """Bytes of one page of one layer."""
    device_pages: int
    """Pages of the device pool."""
    host_pages: int
    """Pages of the host pool."""
    host_layout: str
    """``page_first`` or ``layer_first``."""
    device_layer_stride: int = 0
    """Device rows from one layer of a page to the next: ``device_pages`` when 0 (the
    layer-first ``DevicePool``); 1 in a unified arena, whose physical page is a base unit."""
    host_layer_stride: int = 0
    """Host rows from one layer of a page to the next in a relocatable host arena, whose
    physical page is a base unit (1 page-first, its slot count layer-first); 0 for a
    ``HostPool`` (its ``host_layout`` says)."""

    @property
    def envelope(self) -> bool:
        """A page's layers are consecutive device rows (a unified arena's envelope)."""
        return self.device_layer_stride == 1

    @property
    def layer_stride(self) -> int:
        """Device rows from one layer of a page to the next."""
        return self.device_layer_stride or self.device_pages

    @property
    def whole_pages(self) -> bool:
        """All layers of a page are one block on both sides (an envelope, a page-first host):
        copy-engine blocks are whole pages, listed page-major, and staging would add nothing."""
        return self.envelope and self.host_layout == "page_first"

    def device_rows(
        self, pages: torch.Tensor, layer: int | None = None, page_major: bool = False
    ) -> torch.Tensor:
        """Device row numbers of ``pages`` (int64, on the pages' device), layer-major: all pages
        of the first layer, then the next layer's; one layer only when ``layer`` is given;
        ``page_major`` orders them all layers of the first page, then the next page's."""
        offsets = _offsets(self.layers, layer, self.layer_stride, pages.device)
        return _rows(pages, 1, offsets, page_major)

    def host_rows(
        self, pages: torch.Tensor, layer: int | None = None, page_major: bool = False
    ) -> torch.Tensor:
        """Host row numbers of ``pages`` in the same order as :meth:`device_rows`."""
        if self.host_layer_stride:
            offsets = _offsets(self.layers, layer, self.host_layer_stride, pages.device)
            return _rows(pages, 1, offsets, page_major)
        if self.host_layout == "page_first":
            offsets = _offsets(self.layers, layer, 1, pages.device)
            return _rows(pages, self.layers, offsets, page_major)
        offsets = _offsets(self.layers, layer, self.host_pages, pages.device)
        return _rows(pages, 1, offsets, page_major)

    def mean_run(self, host_pages: torch.Tensor, device_pages: torch.Tensor) -> float:
        """Mean rows per block when rows contiguous on both sides are merged (one layer; for
        :attr:`whole_pages`, page-major: a page's layers then are one block)."""
        n = host_pages.numel()
        if n == 0 or (self.host_layout == "page_first" and self.layers > 1 and not self.envelope):
            return 1.0
        # numpy: a handful of torch CPU ops cost ~0.2 ms here, a tenth of that in numpy, and this
        # runs before the first copy of every batch is queued.
        h, d = host_pages.numpy(), device_pages.numpy()
        if self.whole_pages:
            hstep = self.layers if self.host_layer_stride == 1 else 1  # arena: base units
            breaks = np.count_nonzero((np.diff(h) != hstep) | (np.diff(d) != self.layers))
            return n * self.layers / (breaks + 1)
        breaks = np.count_nonzero((np.diff(h) != 1) | (np.diff(d) != 1))
        return n / (breaks + 1)

    def host_run(self, host_pages: torch.Tensor) -> float:
        """Mean host pages per run of consecutive host pages: the whole pages a staged copy
        moves per copy-engine block (its staging side is always contiguous); 1 when empty."""
        return mean_run_length(host_pages) if host_pages.numel() else 1.0


def mean_run_length(ids: torch.Tensor) -> float:
    """Mean length of the runs of consecutive ids in ``ids`` (CPU, in order, not empty)."""
    return ids.numel() / (np.count_nonzero(np.diff(ids.numpy()) != 1) + 1)


def _offsets(layers: int, layer: int | None, stride: int, device: torch.device) -> torch.Tensor:
    """Row offsets ``l * stride`` of every layer (or of ``layer`` alone), built once per
    stream: building them cost kernel launches before every batch's first copy. Per stream,
    so that the kernels using them always follow the ones that wrote them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return _offsets_on(layers, layer, stride, device, stream)


@functools.lru_cache(maxsize=1024)
def _offsets_on(
    layers: int, layer: int | None, stride: int, device: torch.device, stream: int
) -> torch.Tensor:
    if layer is None:
        return torch.arange(layers, dtype=torch.int64, device=device) * stride
    return torch.tensor([layer * stride], dtype=torch.int64, device=device)


def _rows(
    pages: torch.Tensor, page_stride: int, offsets: torch.Tensor, page_major: bool
) -> torch.Tensor:
    """``pages * page_stride + offsets`` for every page and offset as one flat list, layer-major
    (all pages at the first offset first) or page-major; one broadcast add, no transpose."""
    p = pages if page_stride == 1 else pages * page_stride
    if page_major:
        return (p[:, None] + offsets[None, :]).reshape(-1)
    return (offsets[:, None] + p[None, :]).reshape(-1)


def choose(
    geo: RowGeometry,
    direction: str,
    host_pages: torch.Tensor,
    device_pages: torch.Tensor,
    per_layer: bool = False,
    dma: bool = True,
    mechanism: str = "auto",
    shared_link: bool = False,
    host_run: float | None = None,
) -> str:
    """The mechanism for moving ``host_pages`` ↔ ``device_pages`` of one component.

    ``direction`` is ``"h2d"`` or ``"d2h"``; ``per_layer`` asks for a copy that completes layer by
    layer (kernels under ``auto``, see below); ``dma`` is false where copy engines cannot be used
    (no pinned host pool, no driver support); ``shared_link``: a copy the other way runs beside
    (``SHARED_D2H_DMA_MIN_BYTES``, ``SHARED_H2D_DMA_MIN_BYTES``); ``host_run``: the mean run
    of consecutive ``host_pages`` where the caller has it (``RowGeometry.host_run``). ``mechanism``
    (``CacheConfig.transfer_mechanism``) forces ``kernel`` (row kernels only) or ``copy_engine``
    (staged for multi-layer components, else direct blocks; direct blocks per layer) whatever
    the block size. Envelope rows (a
    unified arena) are never staged: with a page-first host their pages already are blocks.

    Under ``auto`` the larger blocks win: staged blocks are the mean run of consecutive host
    pages times whole pages (page-first host) or rows (layer-first host), direct blocks rows
    times the mean run contiguous on both sides.
    Staging is taken when its blocks are ``STAGE_GAIN`` times larger (or direct ones are too
    small), since it adds a gather or scatter on the device. A layer-first host (of more than one
    layer) stages whenever its blocks are no smaller than direct ones: both ways at once, its
    direct loads beside staged backups moved 0.57-0.89 of two contiguous copies where staged
    loads moved 0.77-0.95, and 0.57-0.74 against 0.77-0.95 for DSA-compressed and hybrid;
    one way, 0.90-0.95 direct against 0.92-0.97 staged (``results/h200-dma/run12/
    layer_first_choice.json``, the six cells whose loads went direct). Both ways at once on an
    H200, with host pages in node runs (``results/h200-dma/README.md``, runs 9 and 10), staged
    copies both ways moved 0.85-0.95 of two contiguous copies; forced direct blocks fell to 0.01
    where rows are small (MLA and DSA at page size 1).
    """
    # A host arena's pages are not page-sized blocks at page strides: never staged.
    stageable = not per_layer and not geo.envelope and not geo.host_layer_stride
    if mechanism == "copy_engine" and dma:
        if stageable and geo.layers > 1:
            return STAGED
        return DIRECT
    if not dma or per_layer or mechanism == "kernel":
        # Layer by layer a load overlaps the forward, whose kernels the same CPU thread issues;
        # copy-engine lists cost the driver about 1 µs of CPU per block (65,536 blocks for a
        # 32K-token Llama-8B prefix), which would delay the forward, while a kernel launch per
        # layer costs microseconds. Measured: 87.9 ms TTFT with kernels, 123.8 ms with blocks.
        return KERNEL
    if direction == "h2d":
        least = SHARED_H2D_DMA_MIN_BYTES if shared_link else H2D_DMA_MIN_BYTES
    else:
        least = SHARED_D2H_DMA_MIN_BYTES if shared_link else D2H_DMA_MIN_BYTES
    direct = geo.row_bytes * geo.mean_run(host_pages, device_pages)
    host_block = geo.row_bytes * (geo.layers if geo.host_layout == "page_first" else 1)
    staged = 0.0
    if stageable:
        staged = host_block * (geo.host_run(host_pages) if host_run is None else host_run)
    gain = 1 if geo.host_layout == "layer_first" and geo.layers > 1 else STAGE_GAIN
    if staged >= least and staged >= gain * direct:
        return STAGED
    if direct >= least:
        return DIRECT
    if staged >= least:
        return STAGED
    return KERNEL


def staging_slices(
    pages: int, page_bytes: int, staging_bytes: int, direction: str, shared_link: bool = False
) -> list[int]:
    """Pages per staging slice of a staged copy of ``pages`` pages, in order (the first slice
    from ``SHARED_FIRST_SLICE_BYTES`` where ``shared_link``).

    Two buffers of ``staging_bytes / 2`` take turns, so a slice holds at most that much. The
    pipeline has one step no copy engine overlaps: the first gather of a d2h copy, the last
    scatter of an h2d copy. With one flat slice size that step took a whole buffer (128 MiB at
    the staging gather's 177 GB/s: 0.88 of a contiguous copy for a 575 MB MLA backup). Slices
    therefore grow by half from ``FIRST_SLICE_BYTES`` up to the buffer, toward the end a copy
    engine overlaps; growth stays below the gather-to-link speed ratio (about 3), so each gather
    still finishes before the copy of the slice before it. With the whole batch queued ahead of
    the GPU, MLA, dense and hybrid backups then ran at 0.96-0.97 of a contiguous copy (0.91-0.95
    with flat slices).

        d2h   16, 24, 36, 54, ... MiB, cap, cap, ..., rest
        h2d   the same sizes, reversed
    """
    cap = max(1, staging_bytes // (2 * page_bytes))
    first = SHARED_FIRST_SLICE_BYTES if shared_link else FIRST_SLICE_BYTES
    size = max(1, min(cap, first // page_bytes))
    sizes: list[int] = []
    left = pages
    while left > 0:
        take = min(size, left)
        sizes.append(take)
        left -= take
        size = min(cap, max(size + 1, size * 3 // 2))
    return sizes if direction == "d2h" else sizes[::-1]

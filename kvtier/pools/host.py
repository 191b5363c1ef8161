"""The host (L2) pool: pinned CPU memory (when CUDA is present), one page id space.

Layouts per component (``r`` = the component's rows per page: tokens for the anchor, groups
for a compressed sidecar, one for a state pool):

    page_first   buffers[name][page, layer, row, *shape]         one page is one contiguous block
    layer_first  buffers[name][layer, page * r + row, *shape]    same layout as the device pool

With a page codec (``kvtier.pools.codec``) a lossy component's buffer holds its codes and a
``<name>.scale`` buffer its scales, in the same layout (one row per page and layer).

Pinned on CUDA, the buffers are pinned in the background (``kvtier.pools.pinning``): the pool is
returned once its first chunk of pages is, and its allocator hands out only pages whose bytes
are pinned in every buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch

from kvtier.errors import ConfigError
from kvtier.pools.allocator import PageAllocator
from kvtier.pools.codec import PageCodec, get_codec, host_specs
from kvtier.pools.pinning import (
    DEFAULT_ALIGN,
    DEFAULT_CHUNK_BYTES,
    CudaRegistrar,
    HostPinner,
    Region,
    Registrar,
    lazy_zeros,
)
from kvtier.pools.spec import PoolSpec, component_buffer, page_words
from kvtier.types import Tier


class HostPool:
    """Host copies of pages for every component of the pool set; a page is ``page_size``
    tokens, the tree page (units in ``kvtier.pools``)."""

    tier: ClassVar[Tier] = "host"

    def __init__(
        self,
        specs: Sequence[PoolSpec],
        num_pages: int,
        page_size: int,
        layout: str = "page_first",
        pin: bool = False,
        lanes: int = 1,
        codec: str | PageCodec = "none",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        registrar: Registrar | None = None,
        background: bool = True,
        align: int = DEFAULT_ALIGN,
    ) -> None:
        """``num_pages`` physical pages; ``lanes`` as for ``DevicePool``. ``specs`` are the
        device pool's; the pool holds ``codec``'s host specs of them (:attr:`specs`; the same
        specs without a codec).

        ``pin`` with CUDA (or with a ``registrar``, which then stands in for the driver): the
        buffers are pinned ``chunk_bytes`` of pages at a time (:attr:`pinner`), the first chunk
        before this returns, the others on a background thread (``background=False``: by
        :meth:`HostPinner.pin_next_chunk` calls), and the allocator hands out a page once its
        chunk is pinned. Under context parallelism (``lanes > 1``) every chunk is pinned
        here: ranks must hand out the same ids, so readiness cannot depend on one rank's
        timing. ``pin`` without CUDA or a registrar allocates with ``pin_memory=True`` as
        torch does it."""
        if layout not in ("page_first", "layer_first"):
            raise ConfigError(f"host_layout={layout!r} is not one of page_first, layer_first")
        self.codec = get_codec(codec) if isinstance(codec, str) else codec
        """How lossy components are held (``none``: every component exactly)."""
        self.device_specs = tuple(specs)
        """The device pool's specs these pages back up."""
        specs = host_specs(specs, self.codec, page_size)
        self.specs = specs
        """What the pool holds: the device specs, lossy ones in coded form with their scale
        sidecars (``kvtier.pools.codec.host_specs``)."""
        self.page_size = page_size
        self.num_pages = num_pages
        self.layout = layout
        self.pinned = pin
        self.buffers: dict[str, torch.Tensor] = {}
        later = pin and (registrar is not None or torch.cuda.is_available())
        for s in specs:
            r = s.rows_per_page(page_size)
            if layout == "page_first":
                shape = (num_pages, s.num_layers, r, *s.row_shape)
            else:
                shape = (s.num_layers, num_pages * r, *s.row_shape)
            if later:
                self.buffers[s.name] = lazy_zeros(shape, s.dtype, align)
            else:
                self.buffers[s.name] = torch.zeros(shape, dtype=s.dtype, pin_memory=pin)
        self.pinner: HostPinner | None = None
        """Pins the buffers chunk by chunk (``None`` when they are pageable or were allocated
        pinned)."""
        ready: Callable[[], int] | None = None
        if later:
            regions = [
                Region.of(b, 1 if layout == "page_first" else b.shape[0], num_pages)
                for b in self.buffers.values()
            ]
            if registrar is None:
                registrar = CudaRegistrar(
                    f"host tier ({num_pages} pages, {self.nbytes / 2**30:.1f} GiB)"
                )
            pinner = HostPinner(
                regions,
                num_pages,
                registrar,
                chunk_bytes,
                first_chunks=1 if lanes == 1 else num_pages,
                background=background,
                align=align,
                keep=tuple(self.buffers.values()),
            )
            self.pinner = pinner
            fin = weakref.finalize(self, pinner.release)
            fin.atexit = False  # at exit the process unpins all at once

            def logical_ready() -> int:
                return pinner.ready_items * lanes  # logical id = physical * lanes + lane

            ready = logical_ready
        self.allocator = PageAllocator(num_pages * lanes, name="host", lanes=lanes, ready=ready)

    @property
    def logical_pages(self) -> int:
        """Page ids the allocator hands out (``num_pages`` without context parallelism)."""
        return self.allocator.num_pages

    @property
    def page_bytes(self) -> int:
        return sum(s.page_bytes(self.page_size) for s in self.specs)

    @property
    def pages_ready(self) -> int:
        """Logical pages whose bytes are pinned (all of them without background pinning)."""
        if self.pinner is None:
            return self.logical_pages
        lanes = self.allocator.lanes
        return min(self.logical_pages, self.pinner.ready_items * lanes)

    @property
    def pin_seconds(self) -> float:
        """Seconds background pinning took (so far, while it runs); 0 without it."""
        return self.pinner.seconds if self.pinner is not None else 0.0

    def close(self) -> None:
        """Stop background pinning (the thread is joined; pages not pinned by then are never
        handed out). The memory stays pinned until the pool is garbage."""
        if self.pinner is not None:
            self.pinner.stop()

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    def page_bytes_view(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """``[layers, pages, bytes-per-layer-page]`` raw view in either layout (no copy) of
        component ``name`` — or of ``buffer``, an alias of it (e.g. a device mapping)."""
        buf = component_buffer(self.buffers, name, self.tier) if buffer is None else buffer
        if self.layout == "layer_first":
            return page_words(buf, 0, self.num_pages)
        return page_words(buf, 1, self.num_pages).transpose(0, 1)

    def page_view(self, name: str, page: int) -> torch.Tensor:
        """``[layers, rows, *shape]`` view of one page (page-first only: no copy)."""
        if self.layout != "page_first":
            raise ConfigError("page_view needs host_layout='page_first'")
        return component_buffer(self.buffers, name, self.tier)[page]

    def read_pages(self, name: str, pages: torch.Tensor) -> torch.Tensor:
        """Copy of ``pages`` as ``[n, layers, rows, *shape]`` (the page-first object layout)."""
        buf = component_buffer(self.buffers, name, self.tier)
        raw = _raw(buf)
        if self.layout == "page_first":
            return raw.index_select(0, pages).view(buf.dtype)
        layers = buf.shape[0]
        view = raw.view(layers, self.num_pages, -1, *buf.shape[2:])
        return view.index_select(1, pages).transpose(0, 1).contiguous().view(buf.dtype)

    def write_pages(self, name: str, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Store ``data`` (``[n, layers, rows, *shape]``) into ``pages``."""
        buf = component_buffer(self.buffers, name, self.tier)
        raw, data = _raw(buf), _raw(data)
        if self.layout == "page_first":
            raw.index_copy_(0, pages, data)
            return
        layers = buf.shape[0]
        view = raw.view(layers, self.num_pages, -1, *buf.shape[2:])
        view.index_copy_(1, pages, data.transpose(0, 1))

    def check_integrity(self) -> None:
        self.allocator.check_integrity()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as raw bytes of the same shape where CPU index ops lack its element type (a
    codec's float8 codes); else ``t`` itself."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t

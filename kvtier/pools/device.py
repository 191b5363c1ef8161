"""The device (L1) pool: what attention reads. Layer-first: ``buffers[name][layer, row, *shape]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from kvtier.errors import IntegrityError
from kvtier.paging import pages_to_locs
from kvtier.pools.allocator import PageAllocator
from kvtier.pools.spec import PoolSpec, component_buffer, page_words, validate_pool_set
from kvtier.types import Tier


class DevicePool:
    """One buffer per component of the model's pool set, all sharing page ids.

    A page is ``page_size`` tokens: the tree page, not ``CacheConfig.page_size`` (units in
    ``kvtier.pools``). Page ``p`` owns anchor token slots
    ``[p * page_size, (p + 1) * page_size)``, sidecar rows ``slot // tokens_per_row`` of those
    slots, and state row ``p``. The allocator is the single owner of free pages; the tree only
    records which pages it holds.
    """

    tier: ClassVar[Tier] = "device"

    def __init__(
        self,
        specs: Sequence[PoolSpec],
        num_pages: int,
        page_size: int,
        device: torch.device,
        lanes: int = 1,
    ) -> None:
        """``num_pages`` physical pages; with ``lanes > 1`` (a context-parallel rank) the
        allocator hands out the group's ``num_pages * lanes`` logical ids, of which this pool
        holds lane ``rank``'s (the translator maps them, ``kvtier.parallel.layout``)."""
        validate_pool_set(specs)
        self.specs = tuple(specs)
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = device
        self.allocator = PageAllocator(num_pages * lanes, name="device", lanes=lanes)
        self.buffers: dict[str, torch.Tensor] = {}
        for s in specs:
            rows = num_pages * s.rows_per_page(page_size)
            self.buffers[s.name] = torch.zeros(
                (s.num_layers, rows, *s.row_shape), dtype=s.dtype, device=device
            )

    @property
    def logical_pages(self) -> int:
        """Page ids the allocator hands out (``num_pages`` without context parallelism)."""
        return self.allocator.num_pages

    @property
    def anchor(self) -> torch.Tensor:
        """Buffer of the first (anchor) component."""
        return self.buffers[self.specs[0].name]

    def layer(self, layer: int, name: str | None = None) -> torch.Tensor:
        """``[rows, *row_shape]`` view of one layer of a component (the anchor by default)."""
        return component_buffer(self.buffers, name or self.specs[0].name, self.tier)[layer]

    @property
    def page_bytes(self) -> int:
        return sum(s.page_bytes(self.page_size) for s in self.specs)

    def page_bytes_view(self, name: str) -> torch.Tensor:
        """``[layers, pages, bytes-per-layer-page]`` raw view (int64 words when they divide)."""
        return page_words(component_buffer(self.buffers, name, self.tier), 0, self.num_pages)

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free_pages(self, pages: torch.Tensor) -> None:
        self.allocator.free(pages)

    def locs(self, pages: torch.Tensor) -> torch.Tensor:
        """Anchor token slots of ``pages``."""
        return pages_to_locs(pages, self.page_size)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        for s in self.specs:
            rows = self.buffers[s.name].shape[1]
            if rows != self.num_pages * s.rows_per_page(self.page_size):
                raise IntegrityError(f"device pool {s.name}: buffer has {rows} rows")

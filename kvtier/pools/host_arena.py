"""The relocatable host (L2) pool: every component's host pages in one byte arena.

``CacheConfig.host_compaction`` other than ``off`` makes the host tier of a window pool set
(sliding-window anchor + window rows) a :class:`HostArena` instead of a fixed ``HostPool``:
the unified arena of ``kvtier.pools.unified_pool`` in host memory, so a host copy made
without window rows (the engine had dropped them) takes only its anchor's bytes and the room
goes to other pages, and holes left by freed envelopes are closed by compaction.

Page ids handed out are logical, as on the device; an envelope's place changes when the
arena compacts. Everything that touches host bytes translates at the moment it does and holds
a lease for as long as it does: copies to and from the device (``kvtier.transfer.page_lists``),
storage writes from host pages and storage reads into them (``kvtier.controller``), including
a backend call abandoned by timeout that may still be using the pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch

from kvtier.errors import ConfigError
from kvtier.pools.pinning import DEFAULT_ALIGN, DEFAULT_CHUNK_BYTES, Registrar
from kvtier.pools.spec import PoolSpec
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.types import Tier


class HostArena(UnifiedPool):
    """A unified arena in (pinned) host memory with the ``HostPool`` interface the transfer and
    storage layers use. ``num_pages`` is sized like a ``HostPool`` of that many pages (same
    bytes); more logical pages fit when some lack their window envelopes.

    Page ids given to :meth:`read_pages` and :meth:`write_pages` are logical (a page has no
    single physical id here: each component's envelope has its own place); the arena
    translates them itself, the pages must be leased by the caller for as long as another
    thread may compact.
    """

    tier: ClassVar[Tier] = "host"

    def __init__(
        self,
        specs: Sequence[PoolSpec],
        num_pages: int,
        page_size: int,
        layout: str = "page_first",
        pin: bool = False,
        compaction: str = "auto",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        registrar: Registrar | None = None,
        background: bool = True,
        align: int = DEFAULT_ALIGN,
    ) -> None:
        """Pinned on CUDA (or with a ``registrar``), the arena is pinned in the background as
        ``UnifiedPool`` says."""
        super().__init__(
            specs,
            num_pages,
            page_size,
            torch.device("cpu"),
            compaction,
            layout=layout,
            pin=pin,
            chunk_bytes=chunk_bytes,
            registrar=registrar,
            background=background,
            align=align,
        )
        if not any(self.windowed):
            raise ConfigError(
                "host_compaction needs a pool set with a window component: without one every "
                "host page has the same bytes and nothing is gained"
            )
        self.pinned = pin
        self.allocator.name = "host"

    @property
    def nbytes(self) -> int:
        return self.bytes_total

    def read_pages(self, name: str, pages: torch.Tensor) -> torch.Tensor:
        """Copy of logical ``pages``' component ``name`` as ``[n, layers, rows, *shape]`` (the
        page-first object layout); each page must hold that envelope."""
        spec = self.specs[self.component(name)]
        rows = self.unit_rows(pages, name)
        words = self.unit_words()[rows]
        r = spec.rows_per_page(self.page_size)
        return words.view(spec.dtype).view(rows.shape[0], spec.num_layers, r, *spec.row_shape)

    def write_pages(self, name: str, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Store ``data`` (``[n, layers, rows, *shape]``) into logical ``pages``' component
        ``name`` envelopes."""
        rows = self.unit_rows(pages, name)
        words = self.unit_words()
        src = data.contiguous().view(torch.uint8).view(rows.shape[0], rows.shape[1], -1)
        words.index_copy_(0, rows.reshape(-1), src.reshape(rows.numel(), -1).view(words.dtype))

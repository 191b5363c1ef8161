"""Logical → physical page translation, applied only at the transfer boundary (contract 1).

The tree and the engine hold *logical* page ids (what the allocators hand out); the pool
buffers are indexed by *physical* pages. A translator maps one to the other per side (device
pool, host pool). Every copy the mover queues and every storage object the codec gathers or
scatters translates its page lists once, here; the engine addresses the device pool through
``TieredCache.kv_buffers`` (a :class:`DeviceKV`), whose ``slots`` use the same device mapping.

A translation must not change while a transfer or a storage read touching the page is in flight
(a relocating allocator holds its pages still until the op completed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.config import TRANSFER_MECHANISMS
from kvtier.errors import ConfigError, IntegrityError
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.pools.unified_pool import UnifiedPool

MECHANISMS = TRANSFER_MECHANISMS
"""``CacheConfig.transfer_mechanism`` choices (see ``kvtier.transfer.plan.choose``)."""


class PageTranslator(Protocol):
    def device_physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Physical device page ids (int64, on the CPU) for logical ``pages``, in order, of
        component ``name`` (the anchor when ``None``; translators whose components share page
        ids ignore it). ``-1`` marks a page without that component (:class:`ArenaTranslator`)."""
        ...

    def host_physical(self, pages: torch.Tensor) -> torch.Tensor:
        """Physical host page ids (int64, on the CPU) for logical ``pages``, in order."""
        ...

    def check(self, device_pages: int, host_pages: int) -> None:
        """Raise ``ConfigError`` unless this maps pools of these sizes one-to-one."""
        ...

    def device_owned(self, pages: torch.Tensor) -> torch.Tensor | None:
        """Bool mask of the logical device ``pages`` whose bytes live in this process's pools,
        or ``None`` when all of them do (everything but a context-parallel rank)."""
        ...


class IdentityTranslator:
    """The plain allocator: logical page ids are physical page ids."""

    def device_physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return pages

    def host_physical(self, pages: torch.Tensor) -> torch.Tensor:
        return pages

    def check(self, device_pages: int, host_pages: int) -> None:
        return None

    def device_owned(self, pages: torch.Tensor) -> torch.Tensor | None:
        return None


class PermutationTranslator:
    """Fixed tables: logical page ``p`` is physical page ``device[p]`` (``host[p]``); a side
    without a table is the identity. Each table must be a permutation of its pool's pages."""

    def __init__(
        self, device: Sequence[int] | None = None, host: Sequence[int] | None = None
    ) -> None:
        self.device = None if device is None else torch.as_tensor(device, dtype=torch.int64)
        self.host = None if host is None else torch.as_tensor(host, dtype=torch.int64)

    def device_physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return _lookup(self.device, pages)

    def host_physical(self, pages: torch.Tensor) -> torch.Tensor:
        return _lookup(self.host, pages)

    def check(self, device_pages: int, host_pages: int) -> None:
        for side, table, n in (
            ("device", self.device, device_pages),
            ("host", self.host, host_pages),
        ):
            if table is None:
                continue
            if table.dim() != 1 or not torch.equal(table.sort().values, torch.arange(n)):
                raise ConfigError(
                    f"translator: the {side} table must be a permutation of the {n} {side} "
                    f"pool pages, got {table.numel()} entries {table.tolist()[:16]}"
                )

    def device_owned(self, pages: torch.Tensor) -> torch.Tensor | None:
        return None


class ArenaTranslator:
    """A :class:`~kvtier.pools.unified_pool.UnifiedPool`: device pages are the base units of
    each component's envelope (``-1`` where a page has none; they move when the pool compacts,
    so translate again for every transfer), host pages are the identity."""

    __slots__ = ("pool",)

    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool

    def device_physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        return self.pool.physical(pages, name)

    def host_physical(self, pages: torch.Tensor) -> torch.Tensor:
        return pages

    def check(self, device_pages: int, host_pages: int) -> None:
        if device_pages != self.pool.logical_pages:
            raise ConfigError(
                f"ArenaTranslator: pool has {self.pool.logical_pages} logical pages, "
                f"not {device_pages}"
            )

    def device_owned(self, pages: torch.Tensor) -> torch.Tensor | None:
        return None


def _lookup(table: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    if table is None:
        return pages
    return table[pages.cpu().long()]


def device_view(
    translator: PageTranslator | None,
    device: DevicePool | UnifiedPool,
    host: HostPool | None,
    group: object | None = None,
) -> tuple[PageTranslator, DeviceKV]:
    """``translator`` (identity when ``None``; an :class:`ArenaTranslator` for a unified pool,
    which refuses any other) checked against the pools' sizes, and the view an engine
    addresses the device pool through. Raises ``ConfigError`` when it does not fit."""
    if isinstance(device, UnifiedPool):
        if translator is not None:
            raise ConfigError(
                f"translator={type(translator).__name__}: a unified device pool translates "
                "its own relocatable pages; pass translator=None"
            )
        translator = ArenaTranslator(device)
    translator = translator or IdentityTranslator()
    translator.check(device.num_pages, host.num_pages if host is not None else 0)
    return translator, DeviceKV(device, translator, group)


class DeviceKV:
    """The device pool as an engine addresses it: :meth:`slots` turns the logical token slots
    the cache hands out into the physical slots that :meth:`layer` views are indexed by
    (a sidecar row is ``physical slot // tokens_per_row``, a state row ``physical slot //
    page_size``: pages are whole tree pages, so both stay inside the physical page).

    Under context parallelism a rank's pool holds only the pages of its lane: :meth:`owned`
    says which logical slots those are (translate only them), and :attr:`group` is the CP
    group (``kvtier.parallel.group.Group``) the engine merges its attention partials over.
    """

    __slots__ = ("_pool", "_translator", "_identity", "group")

    def __init__(
        self,
        pool: DevicePool | UnifiedPool,
        translator: PageTranslator,
        group: object | None = None,
    ) -> None:
        self._pool = pool
        self._translator = translator
        self._identity = isinstance(translator, IdentityTranslator)
        self.group = group
        """The CP group when the pool is one rank's shard (``size > 1``), else ``None``."""

    @property
    def translator(self) -> PageTranslator:
        return self._translator

    @property
    def device(self) -> torch.device:
        return self._pool.device

    @property
    def page_size(self) -> int:
        """Tokens per device page (the tree page)."""
        return self._pool.page_size

    @property
    def num_pages(self) -> int:
        """Logical pages (the group's, under context parallelism)."""
        return self._pool.logical_pages

    def layer(self, layer: int, name: str | None = None) -> torch.Tensor:
        """``[rows, *row_shape]`` view of one layer of a component (the anchor by default),
        indexed by physical slots."""
        return self._pool.layer(layer, name)

    def owned(self, locs: torch.Tensor) -> torch.Tensor | None:
        """Bool mask (on ``locs``' device) of the logical slots ``locs`` whose page this pool
        holds; ``None`` when it holds every page (no context parallelism)."""
        if self._identity:
            return None
        flat = locs.reshape(-1).cpu().long()
        mask = self._translator.device_owned(flat // self._pool.page_size)
        return None if mask is None else mask.reshape(locs.shape).to(locs.device)

    @property
    def window(self) -> PoolSpec | None:
        """The sliding-window component, if the pool set has one."""
        return next((s for s in self._pool.specs if s.kind == "window"), None)

    def slots(self, locs: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Kernel-facing slots of component ``name`` (the anchor by default) for logical slots
        ``locs`` (same shape, dtype int64, same device). A page without an envelope of that
        component (a unified pool's released window) raises ``IntegrityError`` naming it."""
        if self._identity:
            return locs
        ps = self._pool.page_size
        flat = locs.reshape(-1).cpu().long()
        pages = flat // ps
        if name is None:
            phys = self._translator.device_physical(pages)
        else:
            phys = self._translator.device_physical(pages, name)
        if bool((phys < 0).any()):
            p = int(pages[phys < 0][0])
            raise IntegrityError(f"slots: logical page {p} has no {name!r} envelope")
        out = phys * ps + flat % ps
        return out.reshape(locs.shape).to(locs.device)

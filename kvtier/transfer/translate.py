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
from kvtier.errors import ConfigError
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool

MECHANISMS = TRANSFER_MECHANISMS
"""``CacheConfig.transfer_mechanism`` choices (see ``kvtier.transfer.plan.choose``)."""


class PageTranslator(Protocol):
    def device_physical(self, pages: torch.Tensor) -> torch.Tensor:
        """Physical device page ids (int64, on the CPU) for logical ``pages``, in order."""
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

    def device_physical(self, pages: torch.Tensor) -> torch.Tensor:
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

    def device_physical(self, pages: torch.Tensor) -> torch.Tensor:
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


def _lookup(table: torch.Tensor | None, pages: torch.Tensor) -> torch.Tensor:
    if table is None:
        return pages
    return table[pages.cpu().long()]


def device_view(
    translator: PageTranslator | None,
    device: DevicePool,
    host: HostPool | None,
    group: object | None = None,
) -> tuple[PageTranslator, DeviceKV]:
    """``translator`` (identity when ``None``) checked against the pools' sizes, and the view
    an engine addresses the device pool through. Raises ``ConfigError`` when it does not fit."""
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
        self, pool: DevicePool, translator: PageTranslator, group: object | None = None
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

    def slots(self, locs: torch.Tensor) -> torch.Tensor:
        """Physical slots of logical slots ``locs`` (same shape, dtype int64, same device)."""
        if self._identity:
            return locs
        ps = self._pool.page_size
        flat = locs.reshape(-1).cpu().long()
        out = self._translator.device_physical(flat // ps) * ps + flat % ps
        return out.reshape(locs.shape).to(locs.device)

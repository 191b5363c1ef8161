"""The unified device pool: every component's pages in one relocatable byte arena.

Three id spaces, never mixed (each has a ``NewType``)::

    id space         type       range                              who holds it
    logical page     PageId     0 .. logical_pages - 1             the tree, the engine
    base unit        Unit       0 .. units - 1                     transfers (physical page)
    kernel slot      Slot       base * page_size + offset          attention (``layer`` views)

A *unit* is one layer of one page of one component (``page_size`` tokens of rows). A page's
*envelope* of a component holds its ``num_layers`` units: layer ``l`` is unit
``base + l * stride``. Two layouts of the arena (``layout``)::

    layout        placement space                   stride   an envelope takes
    page_first    units (0 .. units - 1)            1        num_layers consecutive units
    layer_first   slots (0 .. slots - 1); a slot    slots    one slot (its first num_layers
                  is one unit in every layer                 layers)

The device pool is page-first (kernels read an envelope's layers as one block); the host
arena (``kvtier.pools.host_arena``) takes either, like the host pool's layouts. Window envelopes
are optional per page (``release_window`` drops them, ``add_window`` gives them back); every
other component's envelope exists while the page is allocated. Envelopes move only in
:meth:`UnifiedPool.compact`, never while leased.

``ArenaAllocator`` is the pool's ``PageAllocator`` interface: what the controller allocates
through.

A pinned host arena on CUDA is pinned in the background (``kvtier.pools.pinning``, items are
places): places not pinned yet are marked ``2`` in the unit map, so neither placement nor
compaction (both look for free ``0`` places) uses them until :meth:`UnifiedPool.poll` frees
them on the allocating thread.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from typing import ClassVar, NewType

import torch

from kvtier.errors import ConfigError, IntegrityError, RequestError
from kvtier.paging import pages_to_locs
from kvtier.pools import envelopes as env
from kvtier.pools.pinning import (
    DEFAULT_ALIGN,
    DEFAULT_CHUNK_BYTES,
    CudaRegistrar,
    HostPinner,
    Region,
    Registrar,
    lazy_zeros,
)
from kvtier.pools.spec import PoolSpec, validate_pool_set
from kvtier.types import Tier

PageId = NewType("PageId", int)
Unit = NewType("Unit", int)
Slot = NewType("Slot", int)

COMPACTION = ("auto", "eager", "off")
LAYOUTS = ("page_first", "layer_first")


class UnifiedPool:
    """A device pool (the ``DevicePool`` interface) whose components share one arena tensor
    ``[units * page_size, *row_shape]`` of ``units = num_pages * sum(num_layers)`` units: the
    bytes of ``DevicePool(specs, num_pages, ...)``.

    ``compaction``: ``auto`` compacts inside an allocation that free units could serve but no
    hole fits; ``eager`` before every allocation; ``off`` never (``available`` then reflects
    fragmentation).

    ``layout`` and ``pin`` are for the host arena (a ``layer_first`` arena and pinned memory);
    the device pool is ``page_first``. A pinned arena with CUDA (or a ``registrar``) is pinned
    as ``HostPool`` pins its buffers (``chunk_bytes``, ``background``, ``align``; its items
    are places).
    """

    tier: ClassVar[Tier] = "device"

    def __init__(
        self,
        specs: Sequence[PoolSpec],
        num_pages: int,
        page_size: int,
        device: torch.device,
        compaction: str = "auto",
        lanes: int = 1,
        layout: str = "page_first",
        pin: bool = False,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        registrar: Registrar | None = None,
        background: bool = True,
        align: int = DEFAULT_ALIGN,
    ) -> None:
        validate_pool_set(specs)
        if compaction not in COMPACTION:
            raise ConfigError(f"compaction={compaction!r} is not one of {', '.join(COMPACTION)}")
        if layout not in LAYOUTS:
            raise ConfigError(f"arena layout={layout!r} is not one of {', '.join(LAYOUTS)}")
        if lanes != 1:
            raise ConfigError(f"a unified {self.tier} pool has one lane, got lanes={lanes}")
        if num_pages <= 0 or page_size <= 0:
            raise ConfigError(
                f"unified pool: num_pages={num_pages} and page_size={page_size} must be positive"
            )
        unit_bytes = {s.name: s.page_bytes(page_size) // s.num_layers for s in specs}
        if len(set(unit_bytes.values())) != 1:
            raise ConfigError(
                "a unified pool needs every component's one-layer page to have the same bytes; "
                f"got {unit_bytes} (page_size={page_size})"
            )
        self.specs = tuple(specs)
        self.page_size = page_size
        self.device = device
        self.compaction = compaction
        self.unit_bytes = next(iter(unit_bytes.values()))
        self.layout = layout
        self.layers = [s.num_layers for s in specs]
        """Layers (units) of each component's envelope."""
        total = num_pages * sum(self.layers)
        if layout == "page_first":
            self.slot_units, self.slots = 1, total
            self.sizes = list(self.layers)
        else:
            self.slot_units = max(self.layers)
            self.slots = total // self.slot_units
            self.sizes = [1] * len(specs)
        """Placement: ``slots`` places of ``slot_units`` units each; an envelope of component
        ``c`` takes ``sizes[c]`` consecutive places."""
        self.stride = 1 if layout == "page_first" else self.slots
        """Units from one layer of an envelope to the next."""
        self.units = self.slots * self.slot_units
        self.windowed = [s.kind == "window" for s in specs]
        self.fixed_units = sum(k for k, w in zip(self.sizes, self.windowed, strict=True) if not w)
        """Places one page takes without its window envelopes."""
        if not self.fixed_units or self.slots < self.fixed_units:
            raise ConfigError(
                f"unified {self.tier} pool: {num_pages} pages hold no page of {len(specs)} "
                "components"
            )
        self.logical_pages = self.slots // self.fixed_units
        self.num_pages = self.logical_pages
        """Logical pages (what the allocator hands out)."""
        anchor = specs[0]
        shape = (self.units * page_size, *anchor.row_shape)
        later = pin and device.type == "cpu"
        later = later and (registrar is not None or torch.cuda.is_available())
        if later:
            self.arena = lazy_zeros(shape, anchor.dtype, align)
        else:
            self.arena = torch.zeros(shape, dtype=anchor.dtype, device=device, pin_memory=pin)
        raw = self.arena.view(-1).view(torch.uint8)
        self.buffers: dict[str, torch.Tensor] = {
            s.name: raw.view(s.dtype).view(self.units * s.rows_per_page(page_size), *s.row_shape)
            for s in specs
        }
        """Each component's reading of the whole arena, indexed by kernel slot (rows)."""
        self._index = {s.name: i for i, s in enumerate(specs)}
        self._units = bytearray(self.slots)
        self._table = torch.full((len(specs), self.logical_pages), -1, dtype=torch.int64)
        self._alive = torch.zeros(self.logical_pages, dtype=torch.bool)
        self._leases = torch.zeros(self.logical_pages, dtype=torch.int64)
        self._lease_total = 0
        """Leases held, all pages together (whether any is, without scanning ``_leases``)."""
        self._free: deque[int] = deque(range(self.logical_pages))
        self.compactions = 0
        """Compactions that moved at least one envelope."""
        self.relocated = 0
        """Pages moved by compactions, counted once per compaction that moved any of theirs."""
        self.pinner: HostPinner | None = None
        """Pins the arena place range by place range (``None`` without background pinning)."""
        self._placeable = self.slots
        """Places ``0 .. _placeable-1`` may hold envelopes; the rest wait for pinning."""
        if later:
            if registrar is None:
                registrar = CudaRegistrar(
                    f"host tier ({num_pages} pages, {self.bytes_total / 2**30:.1f} GiB)"
                )
            self.pinner = HostPinner(
                [Region.of(self.arena, self.slot_units, self.slots)],
                self.slots,
                registrar,
                chunk_bytes,
                background=background,
                align=align,
                keep=(self.arena,),
            )
            fin = weakref.finalize(self, self.pinner.release)
            fin.atexit = False  # at exit the process unpins all at once
            self._placeable = 0
            self._units[:] = b"\x02" * self.slots
            self.poll()
        self.allocator = ArenaAllocator(self)

    def poll(self) -> None:
        """Free the places pinned since the last poll for placement (allocating thread only)."""
        if self.pinner is None or self._placeable == self.slots:
            return
        ready = self.pinner.ready_items
        if ready > self._placeable:
            self._units[self._placeable : ready] = bytes(ready - self._placeable)
            self._placeable = ready

    @property
    def pending_places(self) -> int:
        """Places not pinned yet (none without background pinning)."""
        self.poll()
        return self.slots - self._placeable

    @property
    def pages_ready(self) -> int:
        """Logical pages that fit in the pinned places (all without background pinning)."""
        if self.pending_places == 0:
            return self.logical_pages
        return min(self.logical_pages, self._placeable // self.fixed_units)

    @property
    def pin_seconds(self) -> float:
        """Seconds background pinning took (so far, while it runs); 0 without it."""
        return self.pinner.seconds if self.pinner is not None else 0.0

    def close(self) -> None:
        """Stop background pinning (the thread is joined; places not pinned by then are never
        used). The memory stays pinned until the pool is garbage."""
        if self.pinner is not None:
            self.pinner.stop()

    # ---- views ---------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page with every envelope (window included)."""
        return sum(s.page_bytes(self.page_size) for s in self.specs)

    def layer(self, layer: int, name: str | None = None) -> torch.Tensor:
        """``[rows, *row_shape]`` view of layer ``layer`` of component ``name`` (the anchor by
        default) indexed by kernel slots: slot ``base * page_size + off`` reads unit
        ``base + layer`` (a sidecar row is ``slot // tokens_per_row``)."""
        spec = self.specs[self.component(name)]
        if not 0 <= layer < spec.num_layers:
            raise RequestError(f"pool {spec.name!r} has {spec.num_layers} layers, not {layer}")
        rows = spec.rows_per_page(self.page_size)
        return self.buffers[spec.name][layer * rows :]

    def unit_words(self) -> torch.Tensor:
        """``[units, words]`` raw view of the arena (int64 words when they divide a unit)."""
        flat = self.arena.view(-1).view(torch.uint8).view(self.units, self.unit_bytes)
        return flat.view(torch.int64) if self.unit_bytes % 8 == 0 else flat

    def component_words(self, name: str, pages: torch.Tensor) -> torch.Tensor:
        """Copy of ``[layers, n, words]``: the envelope bytes of ``pages`` (each must have one)."""
        return self.unit_words()[self.unit_rows(pages, name).t().to(self.device)].cpu()

    def unit_rows(self, pages: torch.Tensor, name: str | None) -> torch.Tensor:
        """``[n, layers]`` units (CPU) of the ``name`` envelopes of ``pages``, each of which
        must have one (``IntegrityError`` naming the page otherwise)."""
        base = self.physical(pages, name).reshape(-1)
        if bool((base < 0).any()):
            p = int(pages.reshape(-1)[base < 0][0])
            raise IntegrityError(f"unified {self.tier} pool: page {p} has no {name!r} envelope")
        k = self.layers[self.component(name)]
        return base[:, None] + torch.arange(k)[None, :] * self.stride

    def locs(self, pages: torch.Tensor) -> torch.Tensor:
        """Logical token slots of ``pages`` (what the tree and the engine hold)."""
        return pages_to_locs(pages, self.page_size)

    def component(self, name: str | None) -> int:
        """Index of component ``name`` (the anchor when ``None``)."""
        if name is None:
            return 0
        try:
            return self._index[name]
        except KeyError:
            held = ", ".join(self._index)
            raise RequestError(f"device pool has no component {name!r} (it holds {held})") from None

    # ---- translation ---------------------------------------------------------------------
    def physical(self, pages: torch.Tensor, name: str | None = None) -> torch.Tensor:
        """Base units (int64, CPU, ``pages``' shape) of the ``name`` envelopes of logical
        ``pages``; ``-1`` where a page has none. A free page raises ``IntegrityError``."""
        flat = self._check(pages, "physical")
        return self._table[self.component(name)][flat].reshape(pages.shape)

    def has_window(self, pages: torch.Tensor) -> torch.Tensor:
        """Bool per page: it holds every window envelope (all false without window specs)."""
        flat = self._check(pages, "has_window")
        rows = [self._table[c][flat] >= 0 for c, w in enumerate(self.windowed) if w]
        if not rows:
            return torch.zeros(pages.shape, dtype=torch.bool)
        return torch.stack(rows).all(0).reshape(pages.shape)

    # ---- allocation ----------------------------------------------------------------------
    def alloc_pages(self, n: int) -> torch.Tensor | None:
        return self.allocator.alloc(n)

    def free_pages(self, pages: torch.Tensor) -> None:
        self.allocator.free(pages)

    def take(self, n: int, windows: torch.Tensor | None = None) -> torch.Tensor | None:
        """``n`` logical ids with every envelope, atomically; ``None`` (nothing taken) when
        impossible. Compacts as :attr:`compaction` says. ``windows`` (bool per page): which
        pages get window envelopes (all by default); the others take only the rest."""
        if n < 0:
            raise RequestError(f"{self.tier}: cannot allocate {n} pages")
        if n > len(self._free):
            return None
        self.poll()
        sizes = self._page_sizes(n, windows)
        if self.compaction == "eager":
            self.compact()
        scratch = bytearray(self._units)
        bases = env.place_each(scratch, sizes)
        need = sum(map(sum, sizes))
        if bases is None and self.compaction == "auto" and self.free_units >= need:
            moves, packed = env.plan_compaction(self._units, self._envelopes())
            scratch = bytearray(packed)
            bases = env.place_each(scratch, sizes)
            if bases is not None:
                self._apply(moves)
        if bases is None:
            return None
        ids = torch.tensor([self._free.popleft() for _ in range(n)], dtype=torch.int64)
        self._units = scratch
        if n:
            self._table[:, ids] = torch.tensor(self._rows(bases, sizes), dtype=torch.int64).t()
            self._alive[ids] = True
        return ids

    def fit_prefix(self, windows: torch.Tensor) -> int:
        """How many leading pages of a :meth:`take` with ``windows`` would be served now
        (compaction as its mode allows, leased envelopes fixed)."""
        self.poll()
        sizes = self._page_sizes(windows.numel(), windows)[: len(self._free)]
        maps = [self._units]
        if self.compaction != "off":
            maps.append(env.plan_compaction(self._units, self._envelopes())[1])
        best = 0
        for units in maps:
            scratch, start = bytearray(units), 0
            for i, page in enumerate(sizes):  # lowest fit page by page, as ``take`` places
                if env.place_each(scratch, [page]) is None:
                    break
                start = i + 1
            best = max(best, start)
        return best

    def _page_sizes(self, n: int, windows: torch.Tensor | None) -> list[list[int]]:
        """Envelope sizes each of ``n`` pages takes (without its window ones where
        ``windows`` is false)."""
        if windows is None:
            return [self.sizes] * n
        if windows.numel() != n:
            raise IntegrityError(f"{self.tier}: {windows.numel()} window flags for {n} pages")
        fixed = [k for k, w in zip(self.sizes, self.windowed, strict=True) if not w]
        return [self.sizes if w else fixed for w in windows.tolist()]

    def _rows(self, bases: list[list[int]], sizes: list[list[int]]) -> list[list[int]]:
        """Table rows (a base per component, ``-1`` for a window envelope left out)."""
        out = []
        for b, s in zip(bases, sizes, strict=True):
            if len(s) == len(self.sizes):
                out.append(b)
                continue
            it = iter(b)
            out.append([-1 if w else next(it) for w in self.windowed])
        return out

    def fits(self) -> int:
        """The largest ``n`` :meth:`take` serves now (compaction included, leases fixed)."""
        self.poll()
        cap = len(self._free)
        if self.compaction != "off" and not self._lease_total:
            # compaction packs every envelope below one free block
            return min(cap, self.free_units // sum(self.sizes))
        n0 = 0
        if self.compaction != "eager":
            n0 = env.count(self._units, self.sizes, cap)
            if self.compaction == "off" or n0 == cap:
                return n0
            if self.free_units // sum(self.sizes) <= n0:
                return n0
        _, packed = env.plan_compaction(self._units, self._envelopes())
        return max(n0, env.count(packed, self.sizes, cap))

    def give_back(self, pages: torch.Tensor) -> None:
        """Free logical ``pages`` and every envelope they still have. The batch is validated
        first (free, duplicate, leased: ``IntegrityError``), so a rejected call changes
        nothing."""
        flat = self._check(pages, "free", unique=True)
        self._unleased(flat, "free")
        for p in flat.tolist():
            for c, k in enumerate(self.sizes):
                b = int(self._table[c, p])
                if b >= 0:
                    env.drop(self._units, b, k)
        self._table[:, flat] = -1
        self._alive[flat] = False
        self._free.extend(flat.tolist())

    def release_window(self, pages: torch.Tensor) -> None:
        """Drop the window envelopes of ``pages``; a free or leased page, or one without them,
        raises ``IntegrityError`` (the batch is validated first)."""
        flat = self._check(pages, "release_window", unique=True)
        self._unleased(flat, "release_window")
        missing = flat[~self.has_window(flat)]
        if missing.numel() or not any(self.windowed):
            what = int(missing[0]) if missing.numel() else int(flat[0]) if flat.numel() else -1
            raise IntegrityError(f"release_window: page {what} has no window envelope")
        for c, w in enumerate(self.windowed):
            if not w:
                continue
            for b in self._table[c, flat].tolist():
                env.drop(self._units, b, self.sizes[c])
            self._table[c, flat] = -1

    def add_window(self, pages: torch.Tensor) -> bool:
        """Give ``pages`` (allocated, none holding them) window envelopes, atomically,
        compacting as :attr:`compaction` says; ``False`` (nothing changed) when the free places
        cannot hold them. The rows they hold are stale until written. A leased page may take
        them: the lease holds its other envelopes, which do not move."""
        flat = self._check(pages, "add_window", unique=True)
        held = self.has_window(flat)
        if bool(held.any()) or not any(self.windowed):
            p = int(flat[held][0]) if bool(held.any()) else int(flat[0]) if flat.numel() else -1
            raise IntegrityError(
                f"add_window: page {p} already has a window envelope or none exist"
            )
        if not flat.numel():
            return True
        self.poll()
        sizes = [k for k, w in zip(self.sizes, self.windowed, strict=True) if w]
        if self.compaction == "eager":
            self.compact()
        scratch = bytearray(self._units)
        bases = env.place(scratch, sizes, flat.numel())
        if (
            bases is None
            and self.compaction == "auto"
            and (self.free_units >= flat.numel() * sum(sizes))
        ):
            moves, packed = env.plan_compaction(self._units, self._envelopes())
            scratch = bytearray(packed)
            bases = env.place(scratch, sizes, flat.numel())
            if bases is not None:
                self._apply(moves)
        if bases is None:
            return False
        self._units = scratch
        cols = torch.tensor(bases, dtype=torch.int64).t()
        comps = [c for c, w in enumerate(self.windowed) if w]
        for row, c in zip(cols, comps, strict=True):
            self._table[c, flat] = row
        return True

    def move_window(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand the window envelopes of pages ``src`` to pages ``dst`` (pairwise; no bytes
        move: ``dst`` then reads the rows ``src`` had). Every ``src`` page must have them,
        no ``dst`` page may, none may be leased; the batch is validated first
        (``IntegrityError`` naming the page)."""
        a = self._check(src, "move_window", unique=True)
        b = self._check(dst, "move_window", unique=True)
        if a.numel() != b.numel() or bool(torch.isin(a, b).any()):
            raise IntegrityError(
                f"move_window: {a.numel()} source pages for {b.numel()} destinations, or a page "
                "on both sides"
            )
        self._unleased(torch.cat([a, b]), "move_window")
        has_a, has_b = self.has_window(a), self.has_window(b)
        if not bool(has_a.all()) or not any(self.windowed):
            p = int(a[~has_a][0]) if a.numel() else -1
            raise IntegrityError(f"move_window: source page {p} has no window envelope")
        if bool(has_b.any()):
            raise IntegrityError(f"move_window: page {int(b[has_b][0])} already has one")
        for c, w in enumerate(self.windowed):
            if w:
                self._table[c, b] = self._table[c, a]
                self._table[c, a] = -1

    # ---- leases and compaction -----------------------------------------------------------
    def lease(self, pages: torch.Tensor) -> None:
        """Hold ``pages``' envelopes still (counted per page) until :meth:`unlease`."""
        flat = self._check(pages, "lease")
        self._leases += torch.bincount(flat, minlength=self.logical_pages)
        self._lease_total += flat.numel()

    def unlease(self, pages: torch.Tensor) -> None:
        """Drop one lease per entry of ``pages``; below zero is an ``IntegrityError``."""
        flat = self._check(pages, "unlease")
        left = self._leases - torch.bincount(flat, minlength=self.logical_pages)
        if bool((left < 0).any()):
            p = int(torch.nonzero(left < 0)[0])
            raise IntegrityError(f"unlease of page {p}, which holds no lease")
        self._leases = left
        self._lease_total -= flat.numel()

    def lease_count(self, pages: torch.Tensor) -> torch.Tensor:
        """Leases held on each of ``pages`` (int64, CPU)."""
        return self._leases[pages.reshape(-1).cpu().long()].reshape(pages.shape)

    @property
    def leased(self) -> bool:
        """Whether any page holds a lease."""
        return self._lease_total > 0

    @property
    def leased_pages(self) -> int:
        """Pages holding at least one lease."""
        return int((self._leases > 0).sum())

    def compact(self) -> int:
        """Slide unleased envelopes down over the holes (``envelopes.plan_compaction``),
        copying their bytes on the current stream; returns the envelopes moved."""
        moves, _ = env.plan_compaction(self._units, self._envelopes())
        self._apply(moves)
        return len(moves)

    def _apply(self, moves: list[env.Move]) -> None:
        if not moves:
            return
        layer = [torch.arange(k) * self.stride for k in self.layers]
        src = torch.cat([m.old + layer[m.component] for m in moves])
        dst = torch.cat([m.new + layer[m.component] for m in moves])
        words = self.unit_words()
        # Every source is read before any destination is written: a destination only covers
        # free units or sources of moves planned before it, never an envelope that stays.
        moved = words.index_select(0, src.to(self.device))
        words.index_copy_(0, dst.to(self.device), moved)
        for m in moves:
            env.drop(self._units, m.old, m.size)
        for m in moves:
            env.take(self._units, m.new, m.size)
            self._table[m.component, m.page] = m.new
        self.compactions += 1
        self.relocated += len({m.page for m in moves})

    def _envelopes(self) -> list[env.Envelope]:
        comp, page = torch.nonzero(self._table >= 0, as_tuple=True)
        bases = self._table[comp, page].tolist()
        pinned = (self._leases[page] > 0).tolist()
        return [
            env.Envelope(b, self.sizes[c], c, p, pin)
            for b, c, p, pin in zip(bases, comp.tolist(), page.tolist(), pinned, strict=True)
        ]

    # ---- accounting ----------------------------------------------------------------------
    @property
    def free_units(self) -> int:
        """Free places (units of a page-first arena, slots of a layer-first one)."""
        return self._units.count(0)

    @property
    def units_used(self) -> int:
        return (self._placeable - self.free_units) * self.slot_units

    @property
    def bytes_used(self) -> int:
        return self.units_used * self.unit_bytes

    @property
    def bytes_total(self) -> int:
        """Bytes of the arena (those of a ``DevicePool`` of ``num_pages`` physical pages)."""
        return self.units * self.unit_bytes

    @property
    def window_pages(self) -> int:
        """Allocated pages holding their window envelopes now."""
        if not any(self.windowed):
            return 0
        held = [self._table[c] >= 0 for c, w in enumerate(self.windowed) if w]
        return int(torch.stack(held).all(0).sum())

    @property
    def free_ids(self) -> int:
        return len(self._free)

    def _check(self, pages: torch.Tensor, what: str, unique: bool = False) -> torch.Tensor:
        flat = pages.reshape(-1).cpu().long()
        if flat.numel() == 0:
            return flat
        bad = (flat < 0) | (flat >= self.logical_pages)
        if bool(bad.any()):
            raise IntegrityError(
                f"{what}: page {int(flat[bad][0])} outside 0..{self.logical_pages - 1}"
            )
        dead = ~self._alive[flat]
        if bool(dead.any()):
            raise IntegrityError(f"{what}: page {int(flat[dead][0])} is free")
        if unique and torch.unique(flat).numel() != flat.numel():
            vals, counts = torch.unique(flat, return_counts=True)
            raise IntegrityError(f"{what}: page {int(vals[counts > 1][0])} given twice")
        return flat

    def _unleased(self, flat: torch.Tensor, what: str) -> None:
        held = self._leases[flat] > 0
        if bool(held.any()):
            p = int(flat[held][0])
            raise IntegrityError(f"{what}: page {p} is leased by a transfer in flight")

    def check_integrity(self) -> None:
        """Free + used ids and units add up, envelopes do not overlap, leases are >= 0 and
        only on allocated pages, every allocated page has every non-window envelope, the
        places past the pinned ones are exactly the pending ones."""
        alive = int(self._alive.sum())
        free = list(self._free)
        if len(set(free)) != len(free) or alive + len(free) != self.logical_pages:
            raise IntegrityError(
                f"unified pool: {alive} allocated + {len(free)} free ids != {self.logical_pages}"
            )
        if free and bool(self._alive[torch.tensor(free)].any()):
            raise IntegrityError("unified pool: a free id is marked allocated")
        if int(self._leases.sum()) != self._lease_total:
            raise IntegrityError("unified pool: the lease total disagrees with the lease counts")
        if bool((self._leases < 0).any()) or bool((self._leases[~self._alive] != 0).any()):
            raise IntegrityError("unified pool: negative lease or lease on a free page")
        live = self._table[:, self._alive]
        if live.numel() and bool((live[[not w for w in self.windowed]] < 0).any()):
            raise IntegrityError("unified pool: an allocated page lacks a non-window envelope")
        if bool((self._table[:, ~self._alive] >= 0).any()):
            raise IntegrityError("unified pool: a free page still has an envelope")
        seen = bytearray(self.slots)
        seen[self._placeable :] = b"\x02" * (self.slots - self._placeable)
        for e in self._envelopes():
            if e.base < 0 or e.base + e.size > self.slots or any(seen[e.base : e.base + e.size]):
                raise IntegrityError(
                    f"unified pool: envelope of page {e.page} ({self.specs[e.component].name}) "
                    f"at unit {e.base} overlaps another or leaves the arena"
                )
            env.take(seen, e.base, e.size)
        if seen != self._units:
            raise IntegrityError("unified pool: the unit map disagrees with the envelope table")


class ArenaAllocator:
    """Logical page ids of a unified pool, each allocated with an envelope of every component.

    ``available`` is the largest ``n`` that ``alloc(n)`` serves now (compaction as the pool's
    mode says, leased envelopes fixed): the controller evicts ``n - available`` pages and then
    allocates. It is exact and costs O(1) except while pages are leased under a compacting
    mode: then it is the bound free units allow (``optimistic``), since the exact count means
    simulating the placement around the leased envelopes on every read (hundreds of
    milliseconds at 10^4 pages); the controller evicts more when an allocation it was promised
    fails. ``fit``, ``fit_like`` and ``shortfall`` are always exact. One lane only.
    """

    optimistic_ok = True
    """``available`` may promise more than ``alloc`` serves (see ``optimistic``)."""

    lanes = 1

    def __init__(self, pool: UnifiedPool) -> None:
        self.pool = pool
        self.name = "device"

    @property
    def num_pages(self) -> int:
        return self.pool.logical_pages

    @property
    def optimistic(self) -> bool:
        """Whether ``available`` is an upper bound right now rather than exact."""
        return self.pool.compaction != "off" and self.pool.leased

    @property
    def pending(self) -> int:
        """Logical pages of the places not pinned yet (an estimate: a page's places vary)."""
        return self.pool.pending_places // self.pool.fixed_units

    @property
    def available(self) -> int:
        self.pool.poll()
        if self.optimistic:
            return min(self.pool.free_ids, self.pool.free_units // sum(self.pool.sizes))
        return self.pool.fits()

    @property
    def used(self) -> int:
        return self.pool.logical_pages - self.pool.free_ids

    def available_in(self, lane: int) -> int:
        self._lane(lane)
        return self.pool.fits()

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` logical ids (int64 CPU) with all their envelopes, or ``None`` (nothing taken)."""
        return self.pool.take(n)

    def free(self, pages: torch.Tensor) -> None:
        """Free ids and every envelope they still have (``IntegrityError`` for a free, repeated
        or leased page; the batch is validated first)."""
        self.pool.give_back(pages)

    def fit(self, owners: Sequence[int]) -> int:
        for o in owners:
            self._lane(o)
        return min(len(owners), self.pool.fits())

    def fit_like(self, pages: torch.Tensor) -> int:
        return min(pages.numel(), self.pool.fits())

    def shortfall(self, owners: Sequence[int]) -> dict[int, int]:
        for o in owners:
            self._lane(o)
        short = len(owners) - self.pool.fits()
        return {0: short} if short > 0 else {}

    def alloc_owned(self, owners: Sequence[int]) -> torch.Tensor | None:
        for o in owners:
            self._lane(o)
        return self.alloc(len(owners))

    def check_integrity(self) -> None:
        self.pool.check_integrity()

    def _lane(self, lane: int) -> None:
        if lane != 0:
            raise IntegrityError(f"{self.name}: owner {lane} outside 1 lane (unified pool)")

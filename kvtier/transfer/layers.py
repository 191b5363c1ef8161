"""Per-layer backups: a device → host copy made while the forward that writes the pages runs.

The host pages are reserved before the forward; each time the forward finishes an anchor layer
the engine calls :meth:`Layered.layer_done` and that layer's anchor rows are queued on the backup
stream behind the compute stream's work so far. :meth:`Layered.finish`, after the forward, copies
what is left (every other component: sidecars such as a draft head's KV may be written after the
last target layer, whatever their layer count; and any layer not reported) and records the op's
completion; visibility is the caller's, after ``op.done()`` (contract 3)::

    forward      layer 0 ─ layer 1 ─ ... ─ layer L-1 ─ draft head
    backup            kv 0 ─    kv 1 ─ ...   ─ kv L-1 ─ sidecars ─ event (op done)

On CPU each layer is copied synchronously when reported. On CUDA the rows move by the row kernel
through the device view of the pinned host pool (a pageable one takes the plain backup). A
component the host pool holds coded (``kvtier.pools.codec``) is encoded layer by layer on its
way (``CodedRows.copy``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.errors import IntegrityError
from kvtier.transfer.component import CodedRows, ComponentRows
from kvtier.transfer.op import TransferOp
from kvtier.transfer.page_lists import PageLists
from kvtier.transfer.streams import recorded

if TYPE_CHECKING:
    from kvtier.pools.spec import PoolSpec


class Layered:
    """One per-layer backup of a fixed page list (physical pages, this rank's shard).

    It copies through ``rows`` (each component's rows, by name) of the device pool whose
    components are ``specs`` (anchor first) on ``device``; on CUDA the copies queue on
    ``backup_stream``.
    """

    def __init__(
        self,
        pages: PageLists,
        op: TransferOp,
        *,
        rows: Mapping[str, ComponentRows | CodedRows],
        specs: Sequence[PoolSpec],
        device: torch.device,
        backup_stream: torch.cuda.Stream | None,
    ) -> None:
        self.pages = pages
        self.op = op
        self.rows = rows
        self.specs = tuple(specs)
        self.device = device
        self.cuda = device.type == "cuda"
        self.backup_stream = backup_stream
        self.anchor_layers = specs[0].num_layers
        self._done: dict[str, set[int]] = {s.name: set() for s in specs}
        self._finished = False
        for name in self._done:
            op.paths[name] = "per layer"

    def layer_done(self, layer: int) -> None:
        """Anchor layer ``layer`` of the pages is written: queue its rows (and that layer of
        every component layered like the anchor)."""
        if self._finished:
            raise IntegrityError(f"layer_done({layer}) after the per-layer backup finished")
        if not 0 <= layer < self.anchor_layers:
            raise IntegrityError(f"layer_done({layer}): the anchor has {self.anchor_layers}")
        if not self.op.num_pages:
            return
        anchor = self.specs[0].name
        if layer not in self._done[anchor]:
            self._copy({anchor: [layer]})

    def finish(self) -> TransferOp:
        """Copy every layer not copied yet and mark the op's end; returns the op."""
        if self._finished:
            raise IntegrityError("per-layer backup finished twice")
        self._finished = True
        if self.op.num_pages:
            rest = {
                s.name: [j for j in range(s.num_layers) if j not in self._done[s.name]]
                for s in self.specs
            }
            self._copy({n: ls for n, ls in rest.items() if ls})
        if self.cuda and self.op.num_pages:
            self.op.event = recorded(self.backup_stream)
        return self.op

    def _copy(self, layers: dict[str, list[int]]) -> None:
        pages = self.pages
        for name, ls in layers.items():
            self._done[name].update(ls)
        if not self.cuda:
            for name, ls in layers.items():
                r = self.rows[name]
                for j in ls:
                    r.copy(
                        "d2h", r.geo.host_rows(pages.host, j), r.geo.device_rows(pages.device, j)
                    )
            return
        stream = self.backup_stream
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            stream.wait_stream(compute)  # the layer's rows were written on the compute stream
            with torch.cuda.stream(stream):
                hg, dg = pages.on_gpu(self.device, self.op)
                for name, ls in layers.items():
                    r = self.rows[name]
                    for j in ls:
                        r.copy("d2h", r.geo.host_rows(hg, j), r.geo.device_rows(dg, j), self.op)

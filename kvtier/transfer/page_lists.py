"""The page lists of one transfer: physical host and device pages in matching order, with what
the mechanisms derive from them once per batch (runs of consecutive host pages, the lists on the
GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import IntegrityError
from kvtier.pools.unified_pool import UnifiedPool
from kvtier.transfer.op import TransferOp
from kvtier.transfer.staged_blocks import host_breaks
from kvtier.transfer.streams import recorded
from kvtier.transfer.uploads import Uploads


@dataclass(slots=True)
class PageLists:
    """The pages of one transfer, in matching order.

    ``host`` and ``device`` (physical pages) live on the CPU: the mechanism choice and copy-engine
    addresses read them. Kernels need row numbers on the GPU; :meth:`on_gpu` copies both lists
    there once and the rows are computed on the GPU from them, so a batch never builds or
    uploads its (layers x pages) row lists on the CPU (which for page size 1 took longer than the
    copy itself).
    """

    host: torch.Tensor
    device: torch.Tensor
    uploads: Uploads | None = None
    """Pinned buffers to upload through (a mover's); ``None`` pins a temporary."""
    _host_gpu: torch.Tensor | None = None
    _device_gpu: torch.Tensor | None = None
    device_listed: torch.cuda.Event | None = None
    """Recorded on the stream that uploaded the device page list, right after the upload."""
    _breaks: np.ndarray | None = None

    def on_gpu(self, device: torch.device, op: TransferOp) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host, device)`` page lists on ``device``. The first call queues the copy on the
        current stream, from pinned memory (the host never waits); ``op`` keeps it alive."""
        if self._host_gpu is None and self._device_gpu is None:
            both = self._upload(torch.stack([self.host, self.device]), device, op)
            self._host_gpu, self._device_gpu = both[0], both[1]
            self.device_listed = recorded(torch.cuda.current_stream(device))
        elif self._host_gpu is None:
            self._host_gpu = self._upload(self.host, device, op)
        return self._host_gpu, self.device_on_gpu(device, op)

    def device_on_gpu(self, device: torch.device, op: TransferOp) -> torch.Tensor:
        """The device page list alone on ``device`` (what staging kernels read), copied as by
        :meth:`on_gpu`."""
        if self._device_gpu is None:
            self._device_gpu = self._upload(self.device, device, op)
            self.device_listed = recorded(torch.cuda.current_stream(device))
        return self._device_gpu

    def _upload(self, lists: torch.Tensor, device: torch.device, op: TransferOp) -> torch.Tensor:
        if self.uploads is not None:
            out = self.uploads.upload(lists, device)
        else:
            out = lists.pin_memory().to(device, non_blocking=True)
        op.keepalive.append(out)
        return out

    def host_breaks(self) -> np.ndarray:
        """Where runs of consecutive host pages start (``staging.host_breaks``), worked out
        once for every component and both the mechanism choice and the staged blocks."""
        if self._breaks is None:
            self._breaks = host_breaks(self.host.numpy())
        return self._breaks

    def host_run(self) -> float:
        """Mean host pages per run of consecutive host pages (1 when empty)."""
        n = self.host.numel()
        return n / (self.host_breaks().size + 1) if n else 1.0


def envelope_lists(
    arena: UnifiedPool,
    direction: str,
    device_pages: torch.Tensor,
    host: torch.Tensor,
    names: Sequence[str],
    uploads: Uploads | None = None,
    host_arena: UnifiedPool | None = None,
) -> tuple[dict[str, PageLists], TransferOp]:
    """The page lists of components ``names`` for a transfer of logical ``device_pages`` of
    ``arena`` (base units; only the pages with an envelope of the component, the matching
    physical ``host`` pages) and its op, which leases ``device_pages`` until
    ``op.release()``. With a relocatable ``host_arena`` ``host`` holds its logical pages: the
    host side is its base units too (a window component only where both sides hold the
    envelope), and the op leases the host pages as well."""
    logical = device_pages.reshape(-1).cpu().long()
    host_logical = host
    lists: dict[str, PageLists] = {}
    nbytes = 0
    for s in arena.specs:
        if s.name not in names:
            continue
        phys = arena.physical(logical, s.name)
        have = phys >= 0
        if host_arena is not None:
            host = host_arena.physical(host_logical, s.name)
            have &= host >= 0
        every = bool(have.all())
        if s.kind != "window" and not every:
            raise IntegrityError(f"{direction} transfer: a page has no {s.name!r} envelope")
        lists[s.name] = (
            PageLists(host, phys, uploads) if every else PageLists(host[have], phys[have], uploads)
        )
        nbytes += lists[s.name].device.numel() * s.page_bytes(arena.page_size)
    op = TransferOp(direction, logical.numel(), nbytes)
    arena.lease(logical)
    if host_arena is None:
        op.on_release = lambda: arena.unlease(logical)
        return lists, op
    host_arena.lease(host_logical)

    def release() -> None:
        arena.unlease(logical)
        host_arena.unlease(host_logical)

    op.on_release = release
    return lists, op

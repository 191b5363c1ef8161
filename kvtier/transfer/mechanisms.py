"""Carrying out one component's copy by the mechanism ``plan.choose`` picks for it.

``Mechanisms`` owns whether copy engines may be used: on from the start where the host pool is
pinned and the driver has batched copies (and ``transfer_mechanism`` is not ``kernel``), off for
good once the driver refuses a copy-engine list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from kvtier.transfer import dma
from kvtier.transfer.chunks import queue_all
from kvtier.transfer.component import CodedRows, ComponentRows
from kvtier.transfer.op import TransferOp
from kvtier.transfer.page_lists import PageLists
from kvtier.transfer.plan import DIRECT, KERNEL, STAGED, choose
from kvtier.transfer.streams import recorded

log = logging.getLogger(__name__)


class Mechanisms:
    """The mechanisms of one mover's copies: ``pinned`` (a pinned host pool on CUDA),
    ``mechanism`` (``CacheConfig.transfer_mechanism``), the staging helper streams and
    ``staging_bytes`` of device staging memory per staged copy."""

    def __init__(
        self,
        pinned: bool,
        mechanism: str,
        helpers: dict[str, torch.cuda.Stream],
        staging_bytes: int,
    ) -> None:
        self.pinned = pinned
        self.mechanism = mechanism
        self.helpers = helpers
        self.staging_bytes = staging_bytes
        self.dma = pinned and dma.available() and mechanism != "kernel"
        """Copy engines may be used (switched off for good by a refused list)."""

    def chunks(
        self,
        name: str,
        r: ComponentRows | CodedRows,
        direction: str,
        pages: PageLists,
        stream: torch.cuda.Stream,
        op: TransferOp,
        chunk: int = 0,
    ) -> Iterator[int]:
        """Component ``name``'s copy by its mechanism, as a generator of chunks of about
        ``chunk`` bytes (one chunk per slice or block list when 0; see
        ``kvtier.transfer.pacer``). Returns the host-side finaliser a pageable host pool needs
        after a d2h copy, else ``None``; records the mechanism in ``op.paths``.

        Should the driver refuse a copy-engine list, copy engines are switched off (with a
        warning) and the component is copied again by kernel: the rows already queued are
        rewritten with the same bytes, so nothing is lost.
        """
        if isinstance(r, CodedRows):
            # Coded on the device by torch kernels, the coded rows crossing by row kernel.
            op.paths[name] = "coded"
            yield from r.kernel(direction, pages, op)
            return None
        if not self.pinned:
            op.paths[name] = "unpinned"
            yield pages.host.numel() * r.geo.layers * r.geo.row_bytes
            return r.unpinned(direction, pages, op)
        path = choose(
            r.geo,
            direction,
            pages.host,
            pages.device,
            False,
            self.dma,
            mechanism=self.mechanism,
            shared_link=op.shared_link,
            host_run=pages.host_run(),
        )
        try:
            if path == DIRECT:
                yield from r.direct(direction, pages, stream, chunk=chunk)
            elif path == STAGED:
                helper = self.helpers[direction]
                yield from r.staged(direction, pages, stream, helper, self.staging_bytes, op)
        except dma.DmaError as e:
            log.warning("copy engines disabled, transfers fall back to kernels: %s", e)
            self.dma = False
            path = KERNEL
            stream.wait_stream(self.helpers[direction])  # staging work already queued
        if path == KERNEL:
            yield from r.kernel(direction, pages, op, chunk)
        op.paths[name] = path
        return None

    def load_layers(
        self,
        name: str,
        r: ComponentRows,
        pages: PageLists,
        stream: torch.cuda.Stream,
        op: TransferOp,
    ) -> list[torch.cuda.Event]:
        """Load component ``name`` layer by layer; one event per layer."""
        path = choose(
            r.geo, "h2d", pages.host, pages.device, True, self.dma, mechanism=self.mechanism
        )
        op.paths[name] = path
        events: list[torch.cuda.Event] = []

        def arrived() -> None:
            events.append(recorded(stream))

        if path == DIRECT:
            for layer in range(r.geo.layers):
                queue_all(r.direct("h2d", pages, stream, layer))
                arrived()
        else:
            r.kernel_layers("h2d", pages, op, after_layer=arrived)
        return events

"""The handle of one batched copy between the device and host pools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.errors import TransferError


@dataclass(slots=True)
class TransferOp:
    """One batched copy. ``finalize`` runs once, on the host, after the copy completed."""

    direction: str
    num_pages: int
    nbytes: int
    event: torch.cuda.Event | None = None
    layer_events: list[torch.cuda.Event] | None = None
    finalize: Callable[[], None] | None = None
    keepalive: list[torch.Tensor] = field(default_factory=list)
    paths: dict[str, str] = field(default_factory=dict)
    """Mechanism used per component (``direct``, ``staged``, ``kernel``, ``cpu``, ``unpinned``)."""
    finished: bool = False
    pending: Callable[[], None] | None = None
    """Set while some copies of the op are not yet queued on the GPU (a paced backup, see
    ``kvtier.transfer.pacer``): queues them all. ``event`` is valid once it is ``None``."""
    error: BaseException | None = None
    """Why queueing the copies failed (raised by :meth:`done` and :meth:`wait`)."""
    on_release: Callable[[], None] | None = None
    """Gives back what the op holds while bytes are in flight (a unified pool's leases on its
    device pages); run once, by :meth:`release`."""
    shared_link: bool = False
    """Queued beside a copy the other way (``Mover.exchange``): its staged slices' short
    copy-engine lists go as single copies (``dma.FEW_BLOCKS``)."""
    hold: int = -1
    """Test completion delay (``kvtier.transfer.delays``): how many more :meth:`done` queries
    answer False before the copy's own state is asked; -1: none."""

    def done(self) -> bool:
        """True once the copy completed (never blocks)."""
        if self.hold > 0:
            self.hold -= 1
            return False
        if self.pending is not None:
            return False
        self._raise()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the copy completed."""
        self.hold = min(self.hold, 0)
        if self.pending is not None:
            self.pending()
        self._raise()
        if self.event is not None:
            self.event.synchronize()

    def _raise(self) -> None:
        if self.error is not None:
            raise TransferError(f"{self.direction} transfer failed") from self.error

    def complete(self) -> None:
        """Run the host-side finalisation exactly once (call only when ``done()``), then
        :meth:`release`."""
        if not self.finished:
            self.finished = True
            try:
                if self.finalize is not None:
                    self.finalize()
            finally:
                self.release()
            self.keepalive.clear()

    def release(self) -> None:
        """Run :attr:`on_release` if it has not run yet (the copy is done or never queued)."""
        fn, self.on_release = self.on_release, None
        if fn is not None:
            fn()

    @property
    def holds_lease(self) -> bool:
        """Whether :attr:`on_release` is still to run."""
        return self.on_release is not None

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

    def done(self) -> bool:
        """True once the copy completed (never blocks)."""
        if self.pending is not None:
            return False
        self._raise()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Block the host until the copy completed."""
        if self.pending is not None:
            self.pending()
        self._raise()
        if self.event is not None:
            self.event.synchronize()

    def _raise(self) -> None:
        if self.error is not None:
            raise TransferError(f"{self.direction} transfer failed") from self.error

    def complete(self) -> None:
        """Run the host-side finalisation exactly once (call only when ``done()``)."""
        if not self.finished:
            self.finished = True
            if self.finalize is not None:
                self.finalize()
            self.keepalive.clear()

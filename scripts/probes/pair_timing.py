"""Timing shared by the both-directions probes: the best wall time of a few runs, each after a
device synchronise, and two contiguous copies at once (the both-ways baseline)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` runs of ``fn`` (after one untimed run), each timed
    from a device synchronise to the next."""
    fn()
    best = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    return min(best)


class ContiguousPair:
    """Two device buffers and two pinned host buffers of ``nbytes`` each (``torch.empty_like``
    would drop the pinning), copied one way or both ways at once."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.side = torch.cuda.Stream(device)

    def d2h(self) -> None:
        self.host[0].copy_(self.dev[0], non_blocking=True)

    def both(self) -> None:
        """A device → host copy on the current stream and a host → device one beside it."""
        self.side.wait_stream(torch.cuda.current_stream())
        self.host[1].copy_(self.dev[1], non_blocking=True)
        with torch.cuda.stream(self.side):
            self.dev[0].copy_(self.host[0], non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.side)

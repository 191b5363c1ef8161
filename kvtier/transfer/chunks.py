"""Queueing the chunk generators of ``kvtier.transfer.component`` (see ``kvtier.transfer.pacer``):
a generator yields a chunk's bytes, then queues that chunk when resumed."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from kvtier.transfer.streams import on


def queue_all(chunks: Iterator[int], after: Callable[[], None] | None = None) -> None:
    """Queue every chunk of a chunk generator now, calling ``after()`` once each is queued."""
    if next(chunks, None) is None:
        return
    while True:
        more = next(chunks, None) is not None
        if after is not None:
            after()
        if not more:
            return


def interleave(jobs: list[tuple[Iterator[int], torch.cuda.Stream]], lead: int = 1) -> None:
    """Queue every chunk of several chunk generators, one chunk of each in turn, each
    generator resumed on its own stream. First each job in turn queues chunks until it has
    queued ``lead`` bytes (or all of them), so that every job's copies are going before the
    next one's set-up: a first chunk can be small (a small component's only slice)."""
    live = list(jobs)
    for job in list(live):
        gen, queued = job[0], 0
        with on(job[1]):
            size = next(gen, None)
            # A chunk is queued at the resumption after the one yielding its size.
            while size is not None and queued < lead:
                queued += size
                size = next(gen, None)
        if size is None:
            live.remove(job)
    while live:
        for job in list(live):
            with on(job[1]):
                if next(job[0], None) is None:
                    live.remove(job)

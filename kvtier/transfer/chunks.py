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


def interleave(jobs: list[tuple[Iterator[int], torch.cuda.Stream]]) -> None:
    """Queue every chunk of several chunk generators, one chunk of each in turn, each
    generator resumed on its own stream."""
    live = list(jobs)
    # A chunk is queued at the resumption after the one yielding its size: resume each job
    # twice first, so that every direction's first copy is queued before the next one's set-up.
    for job in list(live):
        with on(job[1]):
            if next(job[0], None) is None or next(job[0], None) is None:
                live.remove(job)
    while live:
        for job in list(live):
            with on(job[1]):
                if next(job[0], None) is None:
                    live.remove(job)

"""Backups queued on the GPU a chunk at a time, at the caller's polls, never more than the link
moves before the next poll.

Copy engines serve the copies queued on them in order, whatever stream queued them: a small
device → host read issued behind a queued backup (a sampler reading its tokens) waits for every
byte of it — 18.1 ms behind one 1 GiB backup on an H200, and a decode step with more backups
queued than the link moved in a step took 1.5-1.7x its time alone (results/h200-dma). So a
backup is never queued whole. It is a sequence of chunks (a generator that yields each chunk's
bytes, then queues it when resumed), and at every :meth:`Pacer.pump` — once per scheduler step,
through ``cache.poll()`` (the reference engine's: once its forward and logits read are queued;
the read is a kernel's stores into mapped memory, which no queued copy delays) — the pacer queues chunks
until the unfinished ones add up to

    share x link rate x time between polls

(both measured: the median of recent chunks and of recent poll intervals), so what one poll
queues finishes before the next step's read, which then finds the engine free (on an H200 the
decode step's logits read took 0.9 ms with paced backups, 71.3 ms behind backups queued whole:
results/h200-dma, probe8). The caller's own thread does all of it; a thread of the mover's own would need the GIL for every chunk, which a caller running
Python without pause gives up only every few milliseconds (1.65 GB/s, results/h200-dma probe5).

Jobs run in submission order. :meth:`flush` queues every chunk up to a given op at once (what
``op.wait()`` does), so waiting never depends on polls.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.errors import ConfigError, IntegrityError
from kvtier.transfer.op import TransferOp

SAMPLES = 8
"""Recent chunk rates and poll intervals the medians are taken over."""


class Mark(Protocol):
    """A point in the queued work (a timing CUDA event on the backup stream)."""

    def query(self) -> bool:
        """Whether the GPU has passed this point (never blocks)."""
        ...

    def seconds_to(self, end: Mark) -> float:
        """Seconds from this point to ``end`` (both passed)."""
        ...


@dataclass(slots=True)
class _Job:
    op: TransferOp
    chunks: Iterator[int]
    next_bytes: int
    """Bytes of the chunk the generator queues when next resumed."""


@dataclass(slots=True)
class _Chunk:
    nbytes: int
    start: Mark
    end: Mark


class Pacer:
    """Queues the chunks of submitted backups at :meth:`pump` within a budget.

    ``share`` is the fraction of the time between two pumps that the chunks queued may keep the
    link busy; ``mark`` records a :class:`Mark` where queued work stands; ``context`` is entered
    around every run of job code (its device and stream); ``clock`` reads seconds.
    Before a rate and an interval are measured one chunk is kept in flight.
    """

    def __init__(
        self,
        share: float,
        mark: Callable[[], Mark],
        context: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not 0 < share <= 1:
            raise ConfigError(f"backup_share={share} must lie in (0, 1] for a pacer")
        self.share = share
        self._mark = mark
        self._context = context
        self._clock = clock
        self._jobs: deque[_Job] = deque()
        self._chunks: deque[_Chunk] = deque()
        self._rates: deque[float] = deque(maxlen=SAMPLES)
        self._intervals: deque[float] = deque(maxlen=SAMPLES)
        self._last_pump: float | None = None
        self.queued_bytes = 0
        """Bytes of every chunk queued so far (a running total)."""

    # ---- submission -----------------------------------------------------------------------
    def submit(self, op: TransferOp, chunks: Iterator[int]) -> None:
        """Take a backup's chunk generator; its set-up (up to the first chunk) runs now, so
        errors in it raise here. ``op.done()`` stays false until its last chunk is queued."""
        with self._context():
            first = next(chunks, None)
        if first is None:
            return
        op.pending = lambda: self.flush(op)
        self._jobs.append(_Job(op, chunks, first))

    # ---- progress -------------------------------------------------------------------------
    def pump(self) -> None:
        """Queue chunks within the budget (call once per scheduler step; never blocks)."""
        now = self._clock()
        if self._last_pump is not None:
            self._intervals.append(now - self._last_pump)
        self._last_pump = now
        self._retire()
        if not self._jobs:
            return
        budget = self.budget()
        unfinished = sum(c.nbytes for c in self._chunks)
        start = None
        with self._context():
            while self._jobs:
                nbytes = self._jobs[0].next_bytes
                if unfinished and unfinished + nbytes > budget:
                    break
                start = self._advance(start)
                unfinished += nbytes

    def flush(self, op: TransferOp | None = None) -> None:
        """Queue every chunk of every job up to ``op`` (all jobs when ``None``)."""
        if op is not None and all(j.op is not op for j in self._jobs):
            return
        start = None
        with self._context():
            while self._jobs:
                head = self._jobs[0]
                while self._jobs and self._jobs[0] is head:
                    start = self._advance(start)
                if head.op is op:
                    return

    def budget(self) -> float:
        """Bytes the unfinished chunks may add up to at a pump (0 until measured)."""
        if not self._rates or not self._intervals:
            return 0.0
        return self.share * statistics.median(self._rates) * statistics.median(self._intervals)

    def pending(self) -> int:
        """Jobs with chunks not yet queued."""
        return len(self._jobs)

    def _advance(self, start: Mark | None) -> Mark:
        """Queue the head job's next chunk (inside the context), after ``start`` — the end of
        the chunk queued just before it, else a fresh mark; returns the chunk's end. Retires
        the job when it has no more chunks."""
        job = self._jobs[0]
        start = start or self._mark()
        try:
            nxt = next(job.chunks, None)
        except Exception as e:  # noqa: BLE001 - the op reports it (done() / wait())
            job.op.error = e
            nxt = None
        end = self._mark()
        self._chunks.append(_Chunk(job.next_bytes, start, end))
        self.queued_bytes += job.next_bytes
        if nxt is None:
            self._jobs.popleft()
            job.op.pending = None
        else:
            job.next_bytes = nxt
        return end

    def _retire(self) -> None:
        """Drop finished chunks, sampling the link rate from each."""
        while self._chunks and self._chunks[0].end.query():
            c = self._chunks.popleft()
            seconds = c.start.seconds_to(c.end)
            if seconds > 0:
                self._rates.append(c.nbytes / seconds)

    def check_integrity(self) -> None:
        """Every waiting job's op is pending, and nothing is counted negative."""
        for job in self._jobs:
            if job.op.pending is None or job.next_bytes < 0:
                raise IntegrityError("pacer job without a pending op or with negative bytes")
        if any(c.nbytes < 0 for c in self._chunks):
            raise IntegrityError("pacer chunk with negative bytes")


class EventMark:
    """A timing event recorded on ``stream`` (a :class:`Mark`)."""

    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def query(self) -> bool:
        return self.event.query()

    def seconds_to(self, end: EventMark) -> float:
        return self.event.elapsed_time(end.event) / 1e3

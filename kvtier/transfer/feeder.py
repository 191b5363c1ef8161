"""Backups fed to the copy engines a window at a time, from a thread of their own.

Copy engines serve the copies queued on them in order, whatever stream queued them: a small
device → host read issued behind a queued backup (a sampler reading its tokens) waits for every
byte of it — 18.1 ms behind one 1 GiB backup on an H200, where a decode step under backups queued
beyond the link's capacity took 1.5-1.7x its time alone (results/h200-dma). So a backup is never
queued whole: the :class:`Feeder` thread issues it in chunks, and the :class:`Window` lets at most
``depth`` unfinished chunks sit on the GPU, waiting (on the feeder thread, never the caller's)
for the oldest before issuing the next. Kernels are not windowed: they use no copy engine.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

import torch

WINDOW_DEPTH = 2
"""Unfinished copy-engine chunks allowed on the GPU: one running, one queued behind it, so the
link never waits for this thread while a read queued behind waits for at most two chunks
(two 128 MiB staging slices: about 5 ms at 55 GB/s)."""


class Window:
    """Bounds the copy-engine chunks queued on the GPU (used on the feeder thread only)."""

    def __init__(self, depth: int = WINDOW_DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"window depth={depth} must be at least 1")
        self.depth = depth
        self._chunks: deque[torch.cuda.Event] = deque()

    def admit(self) -> None:
        """Block until fewer than ``depth`` earlier chunks are unfinished."""
        while self._chunks and self._chunks[0].query():
            self._chunks.popleft()
        while len(self._chunks) >= self.depth:
            self._chunks.popleft().synchronize()

    def issued(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Mark the end of a chunk just queued on ``stream``; returns its event."""
        ev = torch.cuda.Event()
        ev.record(stream)
        self._chunks.append(ev)
        return ev

    def unfinished(self) -> int:
        """Chunks queued and not yet known to be finished (never blocks)."""
        return sum(not ev.query() for ev in self._chunks)


class Feeder:
    """One daemon thread running submitted jobs in order, on ``device`` when it is a GPU.

    A job must not raise: it reports its own errors (see ``TransferOp.error``); an exception that
    escapes is kept and re-raised by the next :meth:`submit` or :meth:`close`.
    """

    def __init__(self, device: torch.device, name: str = "kvtier-backups") -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.window = Window()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; it runs after every job submitted before it."""
        self._check()
        if not self._thread.is_alive():
            raise RuntimeError("Feeder.submit() after close()")
        self._jobs.put(job)

    def close(self) -> None:
        """Run the jobs already queued, then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._check()

    def _check(self) -> None:
        if self._failure is not None:
            raise RuntimeError("a job failed on the feeder thread") from self._failure

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - kept for the submitting thread
                self._failure = e

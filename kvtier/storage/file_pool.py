"""Ordered object I/O for the local-file L3 backend: jobs of one batch run on a small thread
pool (reads, writes and digests release the GIL) and are accounted for in key order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvtier.errors import ConfigError

POOL_MIN_BYTES = 256 << 10
"""Smaller batches run on the calling thread: handing them to a thread costs more than it saves."""


@dataclass
class BatchProgress:
    """How a batch stands while its objects are accounted for in key order."""

    done: int = 0
    """Leading objects that succeeded."""
    failed: bool = False
    """An object failed: later ones no longer count."""


def settled(fut: Future[None] | None) -> bool:
    """``None`` (nothing to wait for) or a finished future."""
    return fut is None or fut.done()


def failed(exc: BaseException) -> Future[None]:
    """A future that already failed with ``exc``."""
    fut: Future[None] = Future()
    fut.set_exception(exc)
    return fut


class OrderedIO:
    """Runs the per-object jobs of a batch on ``threads`` threads (created on first use), or on
    the calling thread when ``threads`` is 1 or the batch is small. Thread-safe."""

    def __init__(self, threads: int, name: str) -> None:
        """Raises ``ConfigError`` naming ``io_threads`` unless ``threads`` is positive."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"io_threads must be a positive integer, got {threads!r}")
        self.threads = threads
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def parallel(self, jobs: int, nbytes: int) -> bool:
        """Whether a batch of ``jobs`` objects holding ``nbytes`` goes to the threads."""
        return jobs > 1 and self.threads > 1 and nbytes >= POOL_MIN_BYTES

    def start(self, job: Callable[[], None], parallel: bool) -> Future[None]:
        """``job`` on a thread when ``parallel``, else run now; its outcome is the future's."""
        if parallel:
            return self._executor().submit(job)
        fut: Future[None] = Future()
        try:
            job()
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
        return fut

    def run_ordered(
        self, jobs: Sequence[Callable[[], None]], nbytes: int
    ) -> tuple[int, BaseException | None]:
        """Run ``jobs``; returns how many leading ones succeeded and the first failure.

        On the calling thread jobs after a failure never start. On the threads, those not yet
        started are cancelled and this waits for the running ones, so no job of the batch
        touches its buffers after this returns."""
        if not self.parallel(len(jobs), nbytes):
            for i, job in enumerate(jobs):
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - handed to the caller in key order
                    return i, e
            return len(jobs), None
        pool = self._executor()
        futures = [pool.submit(job) for job in jobs]
        for i, fut in enumerate(futures):
            failure = fut.exception()
            if failure is not None:
                for later in futures[i + 1 :]:
                    later.cancel()
                wait(futures[i + 1 :])
                return i, failure
        return len(futures), None

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self._name)
            return self._pool

    def close(self) -> None:
        """Wait for running jobs and stop the threads; a later batch starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

"""Helpers the benchmarks share: progress lines on stderr, rates in GB/s and the check that
bytes read back are the bytes written."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch


def logger(bench: str) -> Callable[[str], None]:
    """A function printing ``[bench <bench>] <msg>`` on stderr (flushed) for each ``msg``."""

    def log(msg: str) -> None:
        print(f"[bench {bench}] {msg}", file=sys.stderr, flush=True)

    return log


def gbps(nbytes: int, seconds: float) -> float:
    """``nbytes`` moved in ``seconds``, in GB/s (10^9 bytes per second)."""
    return nbytes / max(seconds, 1e-9) / 1e9


def check_equal(src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` unless ``dst`` holds the bytes of ``src``."""
    if not torch.equal(src, dst):
        raise RuntimeError(f"{what}: bytes read back differ from the bytes written")


class Progress:
    """A progress line on stderr for a long run (``kvtier demo``, ``kvtier bench serve``): a bar
    redrawn in place on a terminal, else a line at each quarter. Thread-safe: concurrent
    clients step one. ``shown=False`` counts silently (a CP rank other than rank 0)."""

    def __init__(self, label: str, total: int, shown: bool = True, unit: str = "requests") -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = self.failed = 0
        self.shown = shown
        self.tty = sys.stderr.isatty()
        self._last_quarter = -1
        self._lock = threading.Lock()

    def step(self, n: int = 1, failed: int = 0) -> None:
        """``n`` more done, ``failed`` of them failed."""
        with self._lock:
            self.done += n
            self.failed += failed
            if self.shown:
                self._show()

    def _show(self) -> None:
        frac = min(1.0, self.done / max(self.total, 1))
        tail = f", {self.failed} failed" if self.failed else ""
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.label:<9} [{bar:<30}] {self.done}/{self.total}{tail}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif int(frac * 4) > self._last_quarter:
            self._last_quarter = int(frac * 4)
            line = f"{self.label}: {self.done}/{self.total} {self.unit}{tail}"
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End a bar left short (a run stopped early) with its line."""
        with self._lock:
            if self.shown and self.tty and self.done < self.total:
                sys.stderr.write("\n")
                sys.stderr.flush()

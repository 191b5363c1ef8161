"""Helpers the benchmarks share: progress lines on stderr, rates in GB/s and the check that
bytes read back are the bytes written."""

from __future__ import annotations

import sys
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

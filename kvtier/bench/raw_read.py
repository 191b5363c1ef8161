"""Plain sequential reads of every file under a directory: the raw L3 read rate a restore from
the file tier is compared with (same files, same run, so the page cache is in the same state
for both)."""

from __future__ import annotations

import os
import time


def read_dir(path: str, chunk: int = 64 << 20) -> tuple[int, float]:
    """``(bytes, seconds)`` to read every regular file under ``path`` once, one after the
    other, through one reused buffer with unbuffered ``readinto`` calls."""
    files = [os.path.join(d, f) for d, _, names in os.walk(path) for f in sorted(names)]
    buf = memoryview(bytearray(chunk))
    total = 0
    t0 = time.perf_counter()
    for name in files:
        try:
            with open(name, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    total += n
        except OSError:
            continue  # a file the backend replaced meanwhile
    return total, time.perf_counter() - t0

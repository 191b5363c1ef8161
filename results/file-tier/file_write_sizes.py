"""One ``write`` per new file of 1, 2 and 4 MiB (numpy ``tofile``, as SGLang's ``HiCacheFile``
writes a page) against the same bytes in 1 MiB ``write`` calls (the file tier's piece size):
median GB/s over FILES (default 64) new files of each kind, alternated, all kept until the
size is done (as a batch of pages stays stored). Usage: ``python file_write_sizes.py [DIR]``."""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np


def main() -> None:
    d = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    for size in (1 << 20, 2 << 20, 4 << 20):
        a = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        view = memoryview(a)
        one, pieces, paths = [], [], []
        for i in range(int(os.environ.get("FILES", "64"))):
            path = os.path.join(d, f"kvtier-write-probe-a{i}")
            paths.append(path)
            t = time.perf_counter()
            a.tofile(path)
            one.append(time.perf_counter() - t)
            path = os.path.join(d, f"kvtier-write-probe-b{i}")
            paths.append(path)
            t = time.perf_counter()
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            for off in range(0, size, 1 << 20):
                os.write(fd, view[off : off + (1 << 20)])
            os.close(fd)
            pieces.append(time.perf_counter() - t)
        for path in paths:
            os.unlink(path)
        print(
            f"{size >> 20} MiB: one write {size / statistics.median(one) / 1e9:.2f} GB/s, "
            f"1 MiB writes {size / statistics.median(pieces) / 1e9:.2f} GB/s",
            flush=True,
        )


if __name__ == "__main__":
    main()

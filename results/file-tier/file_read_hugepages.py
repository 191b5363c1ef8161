"""Reads out of the page cache into a buffer on 4 KiB pages and on transparent huge pages.

    python3 results/file-tier/file_read_hugepages.py [DIR] [FILES] [ROUNDS]

Writes ``FILES`` (default 64) files of 1 MiB under ``DIR`` (default ``/tmp/kvtier-thp``), then,
``ROUNDS`` times (default 5) for each kind of buffer, reads them all (plain ``preadv``, no
checksum) into a fresh anonymous mapping (``MADV_NOHUGEPAGE`` or ``MADV_HUGEPAGE``, touched
first) on one thread and on two; prints the best of five passes in GB/s. The question: would a
host pool on huge pages let the file tier's reads beat two plain threads on 4 KiB pages.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIZE = 1 << 20


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvtier-thp"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"f{i}") for i in range(n)]
    for p in paths:
        if not os.path.exists(p) or os.path.getsize(p) != SIZE:
            with open(p, "wb") as f:
                f.write(os.urandom(SIZE))
    pool = ThreadPoolExecutor(2)

    def read(view: memoryview, i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            os.preadv(fd, [view[i * SIZE : (i + 1) * SIZE]], 0)
        finally:
            os.close(fd)

    def rate(view: memoryview, threads: int) -> float:
        t = time.perf_counter()
        if threads == 1:
            for i in range(n):
                read(view, i)
        else:
            list(pool.map(lambda i: read(view, i), range(n)))
        return n * SIZE / (time.perf_counter() - t) / 1e9

    for _ in range(rounds):
        for huge in (False, True):
            m = mmap.mmap(-1, n * SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
            view = memoryview(m)
            for i in range(0, n * SIZE, 4096):
                view[i] = 1
            one = max(rate(view, 1) for _ in range(5))
            two = max(rate(view, 2) for _ in range(5))
            print(
                f"{'huge pages' if huge else '4 KiB pages'}: 1 thread {one:.2f}, 2 threads {two:.2f} GB/s"
            )
            view.release()
            m.close()


if __name__ == "__main__":
    main()

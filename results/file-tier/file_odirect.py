"""Reads of a 256 MiB file written and synced here: ``O_DIRECT`` (from the disk) against the
page cache, on 1, 2, 4 and 8 threads in 1 MiB and 4 MiB requests into one anonymous mapping
(page-aligned, as ``O_DIRECT`` needs). Usage: ``python file_odirect.py [DIR]``; prints GB/s."""

from __future__ import annotations

import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

N = 256 << 20


def read(path: str, flags: int, threads: int, chunk: int, view: memoryview) -> float:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(lambda o: os.preadv(fd, [view[o : o + chunk]], o), range(0, N, chunk)))
        return N / (time.perf_counter() - t) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    path = os.path.join(sys.argv[1] if len(sys.argv) > 1 else "/tmp", "kvtier-odirect-probe.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * (N >> 20))
    os.sync()
    view = memoryview(mmap.mmap(-1, N))
    try:
        for trial in range(2):
            for threads in (1, 2, 4, 8):
                for chunk in (1 << 20, 4 << 20):
                    direct = read(path, os.O_DIRECT, threads, chunk, view)
                    cached = read(path, 0, threads, chunk, view)
                    print(
                        f"trial {trial} threads {threads} chunk {chunk >> 20} MiB: "
                        f"O_DIRECT {direct:.2f} GB/s, page cache {cached:.2f} GB/s",
                        flush=True,
                    )
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()

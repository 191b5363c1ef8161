"""Verified reads of 1 and 2 MiB objects by piece size: ``batch_get`` on the backend's two I/O
threads with ``file_io.READ_CHUNK`` (the payload bytes per read syscall, each piece digested
right after it lands) at 2 MiB, 1 MiB, 512, 256 and 128 KiB, against the same files' payloads read by
two threads with no digest; interleaved, medians of REPEATS (default 7). A 512 MiB sweep
before every read, the destination zeroed before it; one torch intra-op thread (its threads
spin after a parallel op, beside the read timed next). Usage: ``python file_read_chunk.py [DIR]``; prints GB/s per case."""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.keys import Namespace, PageKey
from kvtier.storage import file_io
from kvtier.storage.file import FileBackend

CHUNKS = (2 << 20, 1 << 20, 512 << 10, 256 << 10, 128 << 10)


def main() -> None:
    work = tempfile.mkdtemp(
        prefix="kvtier-read-chunk-", dir=sys.argv[1] if len(sys.argv) > 1 else "/tmp"
    )
    reps = int(os.environ.get("REPEATS", "7"))
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(1)
    sweep = torch.empty(512 << 20, dtype=torch.uint8)
    try:
        for size, n in ((1 << 20, 64), (2 << 20, 128)):
            src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
            dst = torch.empty_like(src)
            keys = [PageKey(f"{i:032x}") for i in range(n)]
            be = FileBackend(work, Namespace(f"s{size}"), 4 * n * size, io_threads=2)
            if be.batch_set(keys, list(src)) != n:
                raise RuntimeError("batch_set fell short")
            os.sync()
            paths = [be._path(k) for k in keys]
            views = [memoryview(dst[i].numpy()).cast("B") for i in range(n)]

            def raw(paths: list[str] = paths, views: list[memoryview] = views) -> None:
                claim = itertools.count()

                def run() -> None:
                    while (i := next(claim)) < len(paths):
                        fd = os.open(paths[i], os.O_RDONLY)
                        os.preadv(fd, [views[i]], file_io.payload_at(len(views[i])))
                        os.close(fd)

                f = pool.submit(run)
                run()
                f.result()

            res: dict[str, list[float]] = {}
            for r in range(reps):
                for case in ("raw", *CHUNKS):
                    if case != "raw":
                        file_io.READ_CHUNK = case
                    dst.zero_()
                    sweep.fill_(r)
                    t = time.perf_counter()
                    if case == "raw":
                        raw()
                    elif be.batch_get(keys, list(dst)) != n:
                        raise RuntimeError("batch_get fell short")
                    dt = time.perf_counter() - t
                    if not torch.equal(src, dst):
                        raise RuntimeError(f"{case}: bytes differ")
                    name = "raw, 2 threads" if case == "raw" else f"piece {case >> 10} KiB"
                    res.setdefault(name, []).append(n * size / dt / 1e9)
            base = statistics.median(res["raw, 2 threads"])
            for name, v in res.items():
                m = statistics.median(v)
                print(f"{size >> 20} MiB x {n}: {name:16s} {m:5.2f} GB/s ({m / base:.2f} of raw)")
            be.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

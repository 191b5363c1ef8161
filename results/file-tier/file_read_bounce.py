"""Verified reads through a small per-thread bounce buffer, against reads straight into the
destination. Each object's payload is read in BOUNCE-byte pieces into a buffer that stays in
the core's cache, digested there, then copied to the destination (``ctypes.memmove``, GIL
released), so the digest never re-reads bytes from memory. Cases, each on one and two
threads: ``raw`` (one ``preadv`` into the destination, no digest), ``direct`` (one ``preadv``
into the destination, then XXH3 over it: the backend's path), ``bounce N`` (N KiB pieces).
A 512 MiB sweep before every read, destinations zeroed before it; interleaved, medians of
REPEATS (default 7). Usage: ``python file_read_bounce.py [SIZE [N [DIR]]]``; GB/s per case."""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

BOUNCES = (64 << 10, 128 << 10, 256 << 10)


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    work = tempfile.mkdtemp(
        prefix="kvtier-bounce-", dir=sys.argv[3] if len(sys.argv) > 3 else "/tmp"
    )
    reps = int(os.environ.get("REPEATS", "7"))
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(1)
    sweep = torch.empty(512 << 20, dtype=torch.uint8)
    try:
        src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
        want = [xxhash.xxh3_64_intdigest(memoryview(src[i].numpy())) for i in range(n)]
        paths = [os.path.join(work, f"{i:05d}") for i in range(n)]
        for i, p in enumerate(paths):
            with open(p, "wb") as f:
                f.write(memoryview(src[i].numpy()))
        os.sync()
        dst = torch.empty_like(src)
        views = [memoryview(dst[i].numpy()).cast("B") for i in range(n)]
        addrs = [dst[i].data_ptr() for i in range(n)]

        def raw(i: int, _b: object) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            os.preadv(fd, [views[i]], 0)
            os.close(fd)

        def direct(i: int, _b: object) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            os.preadv(fd, [views[i]], 0)
            os.close(fd)
            if xxhash.xxh3_64_intdigest(views[i]) != want[i]:
                raise RuntimeError("digest")

        def bounce(i: int, b: tuple[memoryview, int]) -> None:
            buf, baddr = b
            step = len(buf)
            h = xxhash.xxh3_64()
            fd = os.open(paths[i], os.O_RDONLY)
            off, dest = 0, addrs[i]
            while off < size:
                got = os.preadv(fd, [buf], off)
                piece = buf[:got] if got < step else buf
                h.update(piece)
                ctypes.memmove(dest + off, baddr, got)
                off += got
            os.close(fd)
            if h.intdigest() != want[i]:
                raise RuntimeError("digest")

        def run(fn, threads: int, step: int) -> None:  # noqa: ANN001
            claim = itertools.count()

            def worker() -> None:
                ba = bytearray(step)
                b = (memoryview(ba), ctypes.addressof(ctypes.c_char.from_buffer(ba)))
                while (i := next(claim)) < n:
                    fn(i, b)

            f = pool.submit(worker) if threads == 2 else None
            worker()
            if f is not None:
                f.result()

        cases = [("raw", raw, 1 << 10), ("direct", direct, 1 << 10)]
        cases += [(f"bounce {b >> 10}K", bounce, b) for b in BOUNCES]
        res: dict[str, list[float]] = {}
        for r in range(reps):
            for threads in (1, 2):
                for name, fn, step in cases:
                    dst.zero_()
                    sweep.fill_(r)
                    t = time.perf_counter()
                    run(fn, threads, step)
                    dt = time.perf_counter() - t
                    if not torch.equal(src, dst):
                        raise RuntimeError(f"{name}: bytes differ")
                    res.setdefault(f"{name} t{threads}", []).append(n * size / dt / 1e9)
        for threads in (1, 2):
            base = statistics.median(res[f"raw t{threads}"])
            for name, *_ in cases:
                m = statistics.median(res[f"{name} t{threads}"])
                print(
                    f"{size >> 10} KiB x {n}, {threads} thread(s): {name:12s} {m:5.2f} GB/s ({m / base:.2f} of raw)"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
